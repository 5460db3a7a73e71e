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
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
CSRC = "csrc"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        cand = Path(home) / "bin" / "nvcc"
        return str(cand) if cand.exists() else None
    return shutil.which("nvcc")


def _say(msg: str) -> None:
    # One line on stderr so it shows through pip's output filtering with -v and in logs.
    print(f"zerokern build: {msg}", file=sys.stderr, flush=True)


def _extensions():
    if _flag("ZEROKERN_NO_NATIVE"):
        _say("native module disabled (ZEROKERN_NO_NATIVE); pure Python + Triton only")
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    march = os.environ.get("ZEROKERN_MARCH", "native")
    # The language standard is left to torch (C++17 for torch 2.11, C++20 from 2.13 on).
    cxx = ["-O3", "-fopenmp"]
    if march:
        cxx.append(f"-march={march}")
    cpu_sources = [
        f"{CSRC}/bindings.cpp",
        f"{CSRC}/adam_cpu.cpp",
        f"{CSRC}/sq_norm_cpu.cpp",
        f"{CSRC}/flatten_cpu.cpp",
        f"{CSRC}/arena.cpp",
    ]
    nvcc = None if _flag("ZEROKERN_NO_CUDA") else _find_nvcc()
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}
    if nvcc:
        os.environ.setdefault("CUDA_HOME", str(Path(nvcc).resolve().parent.parent))
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        _say(
            f"building CPU + CUDA kernels (nvcc {nvcc}, archs {os.environ['TORCH_CUDA_ARCH_LIST']})"
        )
        ext = CUDAExtension(
            "zerokern._C",
            cpu_sources
            + [f"{CSRC}/adam_cuda.cu", f"{CSRC}/sq_norm_cuda.cu", f"{CSRC}/flatten_cuda.cu"],
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
