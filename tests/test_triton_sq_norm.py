"""The sq_norm Triton kernels (zerokern/kernels/triton/sq_norm.py) under the Triton
interpreter, without a GPU: against a float64 sum of squares, deterministic, with small blocks
and few partials (several loop iterations per program, the tail block owned by different
programs), and inf/NaN propagation.

The checks run in a subprocess with TRITON_INTERPRET=1 (see triton_common.py); the tests below
assert on the failures and case counts it reports.
"""

from __future__ import annotations

import pytest
import triton_common
from triton_common import Group, assert_group
from triton_common import bits as _bits
from triton_common import start_scripts as start_scripts  # conftest starts the subprocess

# ----------------------------------------------------------------------------------------
# Script side: run under the interpreter by triton_common
# ----------------------------------------------------------------------------------------


def _interp_sq_norm(out):
    import torch
    from _tol import SQ_NORM

    from zerokern.kernels.triton import sq_norm as ks

    grp, special = Group(), Group()
    dtypes = [torch.float32, torch.bfloat16, torch.float16]

    def run(x, name):
        def chk():
            r = ks.sq_norm_triton(x)
            assert r.shape == () and r.dtype == torch.float32, (r.shape, r.dtype)
            ref = x.double().square().sum()
            torch.testing.assert_close(r.double(), ref, rtol=SQ_NORM[0], atol=SQ_NORM[1])
            r2 = ks.sq_norm_triton(x)
            assert torch.equal(_bits(r.reshape(1)), _bits(r2.reshape(1))), "not deterministic"

        grp.check(name, chk)

    for dt in dtypes:
        for n in (0, 1, 7, 4099, 65539):
            x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 4).to(dt)
            run(x, f"n={n} {dt}")
        run(torch.randn(3, 5, 7).to(dt), f"3-D {dt}")
    # Small blocks and few partials: several loop iterations per program and the tail
    # block owned by different programs (n % BLOCK == 0 included).
    saved = ks.BLOCK, ks.MAX_PARTIALS
    try:
        ks.BLOCK, ks.MAX_PARTIALS = 64, 8
        for dt in dtypes:
            for n in (1, 63, 64, 65, 512, 1536, 4099):
                x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dt)
                run(x, f"BLOCK=64 MAX_PARTIALS=8 n={n} {dt}")
    finally:
        ks.BLOCK, ks.MAX_PARTIALS = saved

    inf, nan = float("inf"), float("nan")
    for dt in dtypes:
        for n in (7, 4099, 65539):
            for where, vals, want in (
                ("inf in a full block", {0: inf}, inf),
                ("-inf in the tail", {n - 1: -inf}, inf),
                ("nan", {n // 2: nan}, nan),
                ("inf and nan", {0: inf, n - 1: nan}, nan),
            ):
                x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dt)
                for i, val in vals.items():
                    x[i] = val

                def chk(x=x, want=want):
                    r = ks.sq_norm_triton(x).item()
                    ok = (r != r) if want != want else r == want
                    assert ok, f"got {r}, want {want}"

                special.check(f"{where} n={n} {dt}", chk)
    out["sq_norm"], out["sq_norm_inf_nan"] = grp.result(), special.result()




CHECKS = {"interp": (("sq_norm", _interp_sq_norm),)}


# ----------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interp():
    return triton_common.results("interp", __file__)


def test_sq_norm(interp):
    assert_group(interp, "sq_norm", 30)


def test_sq_norm_inf_nan(interp):
    assert_group(interp, "sq_norm_inf_nan", 30)
