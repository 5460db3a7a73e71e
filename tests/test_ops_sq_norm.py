"""sq_norm on every CPU backend against a float64 sum of squares."""

import math

import pytest
import torch
from _tol import SQ_NORM

from zerokern import ops
from zerokern.ops._backend import available_backends

# The sizes above the kernels' thresholds run their OpenMP split: on two threads, as the
# split is what they test (conftest.py runs the other in-process tests on one).
pytestmark = pytest.mark.usefixtures("two_threads")
CPU_BACKENDS = [b for b in available_backends("cpu") if b != "triton"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("n", [0, 1, 7, 4099, 65539, (1 << 18) + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64(backend, n, dtype):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 5).to(dtype)
    out = ops.sq_norm(x, backend=backend)
    assert out.dtype == torch.float32 and out.dim() == 0
    ref = x.double().square().sum()
    torch.testing.assert_close(out.double(), ref, rtol=SQ_NORM[0], atol=SQ_NORM[1])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "bad,expect", [(math.inf, math.inf), (-math.inf, math.inf), (math.nan, math.nan)]
)
def test_nonfinite_propagates(backend, bad, expect):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.ones(70001, dtype=dtype)
        x[12345] = bad
        out = ops.sq_norm(x, backend=backend).item()
        assert math.isnan(out) if math.isnan(expect) else out == expect, (dtype, out)


def test_fp16_overflowing_squares_are_exact_in_wide_accumulation():
    x = torch.full((1000,), 60000.0, dtype=torch.float16)  # 60000^2 overflows fp16, not fp32
    out = ops.sq_norm(x)
    torch.testing.assert_close(
        out.double(), torch.tensor(1000 * 60000.0**2, dtype=torch.double), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize(
    "bad,exc",
    [
        (torch.zeros(4, 4), ValueError),
        (torch.zeros(8, dtype=torch.int32), TypeError),
        (torch.zeros(8)[::2], ValueError),
        ([1.0], TypeError),
    ],
)
def test_bad_input(bad, exc):
    with pytest.raises(exc, match="t "):
        ops.sq_norm(bad)


def test_opcheck():
    x = torch.randn(1000, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.zerokern.sq_norm.default, (x, CPU_BACKENDS[0]))
