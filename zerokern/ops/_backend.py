"""Backend choice for the ops: an explicit request works or raises; automatic picks the
fastest available for the tensors' device and never falls back silently into wrong results."""

from __future__ import annotations

import importlib.util
import os

import torch

from .. import _native

BACKENDS = ("cuda", "triton", "cpu", "torch")


# Looked up once at import: cheap, and plain data is transparent to torch.compile tracing.
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _HAS_TRITON


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on tensors of `device`, fastest first."""
    dev = torch.device(device)
    out: list[str] = []
    if dev.type == "cuda":
        if _native.has_cuda_kernels():
            out.append("cuda")
        if triton_available():
            out.append("triton")
    elif dev.type == "cpu":
        if _native.has_native():
            out.append("cpu")
        if triton_available() and _triton_interpreting():
            out.append("triton")
    out.append("torch")
    return out


def resolve_backend(backend: str | None, device: torch.device, arg: str = "backend") -> str:
    """The backend to run on `device`: `backend`, else $ZEROKERN_BACKEND, else the fastest."""
    requested = backend if backend is not None else (os.environ.get("ZEROKERN_BACKEND") or None)
    if requested is None:
        return available_backends(device)[0]
    if requested not in BACKENDS:
        raise ValueError(f"{arg} must be one of {BACKENDS} or None, got {requested!r}")
    if requested == "torch":
        return requested
    if requested == "cuda":
        if device.type != "cuda":
            raise ValueError(f"{arg}='cuda' needs CUDA tensors, got tensors on {device}")
        _native.require("cuda")
    elif requested == "cpu":
        if device.type != "cpu":
            raise ValueError(f"{arg}='cpu' needs CPU tensors, got tensors on {device}")
        _native.require("cpu")
    elif requested == "triton":
        if not triton_available():
            raise RuntimeError(f"{arg}='triton' requested but triton is not installed")
        if device.type == "cpu" and not _triton_interpreting():
            raise ValueError(
                f"{arg}='triton' on CPU tensors runs only under the Triton interpreter: "
                "set TRITON_INTERPRET=1 before importing triton"
            )
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"{arg}='triton' does not support device {device}")
    return requested
