"""Loads the optional native module zerokern._C and says which backends it carries.

Import never fails because a backend is missing: callers ask `require(...)` when they need
one explicitly and get an error that says how to get it.
"""

from __future__ import annotations

from types import ModuleType

_C: ModuleType | None
try:
    from zerokern import _C  # type: ignore[attr-defined,no-redef]

    _IMPORT_ERROR: BaseException | None = None
except ImportError as exc:  # built with ZEROKERN_NO_NATIVE, or not built at all
    _C = None
    _IMPORT_ERROR = exc


def has_native() -> bool:
    """Whether the native extension ``zerokern._C`` was built and imports (the ``cpu`` backend
    and the C++ arena need it; ``torch`` and ``triton`` do not)."""
    return _C is not None


def has_cuda_kernels() -> bool:
    """Whether ``zerokern._C`` was built with the CUDA kernels (``nvcc`` found at build time):
    the ``cuda`` backend needs them."""
    return _C is not None and bool(getattr(_C, "WITH_CUDA", False))


def require(backend: str) -> ModuleType:
    """The native module, or a RuntimeError that explains why `backend` is unavailable."""
    if _C is None:
        raise RuntimeError(
            f"zerokern backend {backend!r} needs the native module zerokern._C, which is not "
            f"available ({_IMPORT_ERROR}). Reinstall with `pip install --no-build-isolation .` "
            "without ZEROKERN_NO_NATIVE, or pick backend='torch'/'triton'."
        )
    if backend == "cuda" and not has_cuda_kernels():
        raise RuntimeError(
            "zerokern backend 'cuda' is unavailable: zerokern._C was built without CUDA "
            "kernels (nvcc was not found at build time, or ZEROKERN_NO_CUDA was set). "
            "Rebuild with CUDA_HOME pointing at a CUDA toolkit."
        )
    return _C
