"""Build zerokern._C against the torch found in this environment.

Knobs (environment variables):
  ZEROKERN_NO_NATIVE=1   skip the native module entirely (pure Python + Triton remain)
  ZEROKERN_NO_CUDA=1     build the CPU kernels only even when nvcc is present
  ZEROKERN_MARCH=...     -march for the CPU kernels (default "native"; empty string: none)
  CUDA_HOME, TORCH_CUDA_ARCH_LIST, MAX_JOBS   honoured as torch's BuildExtension does;
  TORCH_CUDA_ARCH_LIST defaults to "8.0;9.0" (A100, H100/H200) when unset.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
CSRC = "csrc"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _toolkit_of(nvcc: str) -> Path | None:
    """The CUDA toolkit root behind an nvcc, which may be a wrapper script elsewhere (e.g.
    /usr/local/bin/nvcc exec'ing /usr/local/cuda-13.0/bin/nvcc): ask nvcc itself."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return Path(line.split("=", 1)[1].strip()).resolve()
    return None


def _find_cuda_home() -> str | None:
    """CUDA_HOME (or CUDA_PATH) if set, else the toolkit of the nvcc on PATH; None if none.
    A toolkit counts only with bin/nvcc and include/cuda_runtime_api.h."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cands = [Path(home)] if home else []
    if not home and shutil.which("nvcc"):
        nvcc = shutil.which("nvcc")
        top = _toolkit_of(nvcc)
        cands += [top] if top else []
        cands.append(Path(nvcc).resolve().parent.parent)
    for c in cands:
        if (c / "bin" / "nvcc").exists() and (c / "include" / "cuda_runtime_api.h").exists():
            return str(c)
    return None


def _say(msg: str) -> None:
    # One line on stderr so it shows through pip's output filtering with -v and in logs.
    print(f"zerokern build: {msg}", file=sys.stderr, flush=True)


def _extensions():
    if _flag("ZEROKERN_NO_NATIVE"):
        _say("native module disabled (ZEROKERN_NO_NATIVE); pure Python + Triton only")
        return [], {}
    cuda_home = None if _flag("ZEROKERN_NO_CUDA") else _find_cuda_home()
    if cuda_home:
        # Before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, at import.
        os.environ["CUDA_HOME"] = cuda_home
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    march = os.environ.get("ZEROKERN_MARCH", "native")
    # The language standard is left to torch (C++17 for torch 2.11, C++20 from 2.13 on).
    cxx = ["-O3", "-fopenmp"]
    if march:
        cxx.append(f"-march={march}")
    cpu_sources = [
        f"{CSRC}/bindings.cpp",
        f"{CSRC}/adam_cpu.cpp",
        f"{CSRC}/adam_compressed_cpu.cpp",
        f"{CSRC}/sq_norm_cpu.cpp",
        f"{CSRC}/flatten_cpu.cpp",
        f"{CSRC}/arena.cpp",
    ]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}
    if cuda_home:
        archs = os.environ["TORCH_CUDA_ARCH_LIST"]
        _say(f"building CPU + CUDA kernels (CUDA_HOME {cuda_home}, archs {archs})")
        ext = CUDAExtension(
            "zerokern._C",
            cpu_sources
            + [f"{CSRC}/adam_cuda.cu", f"{CSRC}/adam_compressed_cuda.cu", f"{CSRC}/sq_norm_cuda.cu",
               f"{CSRC}/flatten_cuda.cu"],
            define_macros=[("ZK_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": cxx,
                "nvcc": ["-O3", "-lineinfo"],
            },
            extra_link_args=["-fopenmp"],
        )
    else:
        _say("nvcc not found (or ZEROKERN_NO_CUDA): building CPU kernels only")
        ext = CppExtension(
            "zerokern._C",
            cpu_sources,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    return [ext], cmdclass


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
