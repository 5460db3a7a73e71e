"""The CUDA compressed kernel's machine code (sm_90 SASS of the built extension, read with the
cuobjdump that ships with Triton): bf16 moments and int8 format version 3 take the folded
update (``kernel_contract.fold_bias_correction``), so each of their instantiations runs one
IEEE division per element less than its unfolded twin (fp32 moments, int8 version 2), and
both drop the same number. Compiled here, it runs on a GPU only (tests/test_gpu_*); this
checks the code that would run. A ``__fdiv_rn`` compiles to one ``MUFU.RCP`` and a call to
the slow path, so the reciprocals count the divisions."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from zerokern import _native

triton = pytest.importorskip("triton")
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
CUBIN = "adam_compressed_cuda.sm_90.cubin"

pytestmark = pytest.mark.skipif(
    not (_native.has_cuda_kernels() and CUOBJDUMP.exists() and shutil.which("c++filt")),
    reason="needs zerokern._C built with the CUDA kernels, Triton's cuobjdump and c++filt",
)


def _kernels(tmp: Path) -> dict[tuple[str, ...], int]:
    """MUFU.RCP count of each adamw_compressed_kernel instantiation, keyed by its template
    arguments (G, P, L, M, V3) as c++filt spells them."""
    lib = _native._C.__file__
    listed = subprocess.run([str(CUOBJDUMP), "-lelf", lib], check=True, capture_output=True,
                            text=True).stdout
    if CUBIN not in listed:  # built for other architectures (TORCH_CUDA_ARCH_LIST)
        pytest.skip(f"the extension has no {CUBIN}")
    subprocess.run([str(CUOBJDUMP), "-xelf", CUBIN, lib], cwd=tmp, check=True,
                   capture_output=True)
    sass = subprocess.run([str(CUOBJDUMP), "-sass", str(tmp / CUBIN)], check=True,
                          capture_output=True, text=True).stdout
    bodies = re.split(r"\n\s*Function : ", sass)[1:]
    names = [b.split("\n", 1)[0].strip() for b in bodies]
    demangled = subprocess.run(["c++filt"], input="\n".join(names), check=True,
                               capture_output=True, text=True).stdout.splitlines()
    out = {}
    for name, body in zip(demangled, bodies):
        m = re.search(r"adamw_compressed_kernel<(.*)>\(", name)
        if m is None:
            continue
        args = tuple(a.strip() for a in re.sub(r"<[^<>]*>", "", m.group(1)).split(","))
        out[args] = len(re.findall(r"\bMUFU\.RCP\b", body))
    return out


def test_folded_formats_drop_one_division_per_element(tmp_path):
    kernels = _kernels(tmp_path)
    twins = defaultdict(dict)  # (G, P, L) -> {(M, V3): reciprocals}
    for (g, p, lp, m, v3), rcp in kernels.items():
        twins[(g, p, lp)][(m, v3)] = rcp
    assert len(twins) >= 12, sorted(twins)  # 3 grads x (bf16 param, fp32 with 3 copies)
    for key, t in twins.items():
        fp32, bf16 = t[("float", "false")], t[("__nv_bfloat16", "false")]
        v2, v3 = t[("unsigned char", "false")], t[("unsigned char", "true")]
        assert fp32 - bf16 > 0, (key, t)  # bf16 moments: folded
        assert v2 - v3 > 0, (key, t)  # version 3: folded
        assert fp32 - bf16 == v2 - v3, (key, t)  # the same division, the same count
