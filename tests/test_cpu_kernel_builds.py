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


@pytest.fixture(scope="module")
def build_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    """Every (source, target) compiled at once, in parallel (the machine's cores do the
    waiting, not the suite): each one's error output, "" when it compiled. (Not named
    ``compiled``: that fixture name asks tests/triton_common.py for its Triton subprocess.)"""
    out_dir = tmp_path_factory.mktemp("kernel_builds")
    procs = {}
    for source in SOURCES:
        for march in TARGETS:
            obj = out_dir / f"{source}.{march}.o"
            cmd = ["g++", "-std=c++20", "-O0", "-fopenmp", f"-march={march}", "-c",
                   str(CSRC / source), "-o", str(obj)]
            procs[source, march] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.PIPE, text=True)
    errors = {}
    for key, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        errors[key] = "" if proc.returncode == 0 else (err or f"exit {proc.returncode}")
    return errors


@pytest.mark.parametrize("march", TARGETS)
@pytest.mark.parametrize("source", SOURCES)
def test_cpu_kernel_compiles_for(source: str, march: str, build_errors) -> None:
    err = build_errors[source, march]
    assert not err, err[-3000:]
