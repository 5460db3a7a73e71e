"""The CPU kernels compile for every instruction set they have a path for.

The extension is built with ``-march=native``, so a build here only compiles the paths of this
machine. These compile the kernel sources (no link, no torch) for the other targets too: the
scalar lanes (x86-64), AVX2 (haswell), AVX-512 without VBMI (skylake-avx512, whose build once
failed on dequant64's byte permutes) and AVX-512 with VBMI (icelake-server).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = ("adam_cpu.cpp", "adam_compressed_cpu.cpp")
TARGETS = ("x86-64", "haswell", "skylake-avx512", "icelake-server")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++"),
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets"),
]


@pytest.mark.parametrize("march", TARGETS)
@pytest.mark.parametrize("source", SOURCES)
def test_cpu_kernel_compiles_for(source: str, march: str, tmp_path: Path) -> None:
    cmd = ["g++", "-std=c++20", "-O0", "-fopenmp", f"-march={march}", "-c",
           str(CSRC / source), "-o", str(tmp_path / "k.o")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
