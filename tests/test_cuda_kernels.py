"""The CUDA kernels (csrc/*_cuda.cu) through zerokern.ops with backend="cuda".

Oracles are independent of the kernels: AdamW is recomputed in float64 from the same fp32
inputs (and the same fp32-rounded step scalars), sq_norm is a float64 sum, the copies are
compared bit for bit with torch.cat / the source tensors. Every test carries the `gpu` marker
(conftest.py skips them without a CUDA device); they are skipped when zerokern._C was built
without CUDA kernels.
"""

from __future__ import annotations

import pytest
import torch
from _tol import ADAM_FP32, SQ_NORM

from zerokern.kernel_contract import AdamScalars, adam_scalars

pytestmark = pytest.mark.gpu

DEV = "cuda"
SIZES = (1, 7, 4099, 65539)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LP_DTYPES = (None, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def zops():
    from zerokern import _native

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not _native.has_cuda_kernels():
        pytest.skip("zerokern._C is not built with CUDA kernels")
    import zerokern.ops

    return zerokern.ops


# ---- helpers ------------------------------------------------------------------------------


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _call_adamw(zops, param, grad, m, v, lp, hp: dict) -> None:
    zops.fused_adamw_(param, grad, m, v, **hp, param_lp=lp, backend="cuda")


def _adamw_ref64(param, grad, m, v, s: AdamScalars):
    """AdamW in float64 from the fp32 inputs, with the step scalars rounded to fp32 first as
    the kernels receive them."""
    sc = AdamScalars(*(_f32(x) for x in s))
    g = grad.double() * sc.inv_grad_scale
    p = param.double() * sc.decay
    m = m.double() + sc.one_minus_beta1 * (g - m.double())
    v = v.double() * sc.beta2 + sc.one_minus_beta2 * g * g
    denom = v.sqrt() / sc.bc2_sqrt + sc.eps
    p = p - sc.step_size * m / denom
    return p, m, v


def _close(out: torch.Tensor, ref: torch.Tensor, what: str, atol_scale: float = 1.0) -> None:
    rtol, atol = ADAM_FP32
    torch.testing.assert_close(
        out.double(), ref, rtol=rtol, atol=atol * atol_scale, msg=lambda m: f"{what}: {m}"
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _flat(buf_numel: int, offset: int, n: int, dtype, fill) -> torch.Tensor:
    """A 1-D view of n elements starting `offset` elements into a fresh buffer."""
    buf = torch.empty(buf_numel, dtype=dtype, device=DEV)
    view = buf[offset : offset + n]
    view.copy_(fill.to(dtype))
    return view


def _make_state(n, gdt, lp_dt, step, grad_scale, offsets=(0, 0, 0, 0, 0), seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    g0 = torch.randn(n, generator=gen) * grad_scale
    if step == 1:
        m0, v0 = torch.zeros(n), torch.zeros(n)
    else:
        m0 = torch.randn(n, generator=gen) * 0.1
        v0 = torch.rand(n, generator=gen) * 0.01
    op, og, om, ov, ol = offsets
    extra = max(offsets) + 1
    param = _flat(n + extra, op, n, torch.float32, p0)
    grad = _flat(n + extra, og, n, gdt, g0)
    m = _flat(n + extra, om, n, torch.float32, m0)
    v = _flat(n + extra, ov, n, torch.float32, v0)
    lp = None if lp_dt is None else _flat(n + extra, ol, n, lp_dt, torch.zeros(n))
    return param, grad, m, v, lp


def _run_and_check(zops, n, gdt, lp_dt, hp, offsets=(0, 0, 0, 0, 0)):
    param, grad, m, v, lp = _make_state(
        n, gdt, lp_dt, hp["step"], hp.get("grad_scale", 1.0), offsets
    )
    s = adam_scalars(**hp)
    ref_p, ref_m, ref_v = _adamw_ref64(param, grad, m, v, s)
    grad_before = grad.clone()
    _call_adamw(zops, param, grad, m, v, lp, hp)
    torch.cuda.synchronize()
    _close(param, ref_p, "param")
    _close(m, ref_m, "exp_avg")
    _close(v, ref_v, "exp_avg_sq", atol_scale=1e-3)
    assert torch.equal(_bits(grad), _bits(grad_before)), "grad was modified"
    if lp is not None:
        # Round-to-nearest-even of the NEW fp32 master, bit for bit.
        assert torch.equal(_bits(lp), _bits(param.to(lp_dt))), "param_lp != param.to(dtype)"


def _hp(wd=0.0, step=1, grad_scale=1.0, beta1=0.9):
    return dict(
        lr=1e-3,
        beta1=beta1,
        beta2=0.999,
        eps=1e-8,
        weight_decay=wd,
        step=step,
        grad_scale=grad_scale,
    )


# ---- AdamW --------------------------------------------------------------------------------


@pytest.mark.parametrize("grad_scale", (1.0, 1024.0))
@pytest.mark.parametrize("step", (1, 1000))
@pytest.mark.parametrize("wd", (0.0, 0.1))
@pytest.mark.parametrize("lp_dt", LP_DTYPES, ids=str)
@pytest.mark.parametrize("gdt", DTYPES, ids=str)
@pytest.mark.parametrize("n", (*SIZES, "offset1"))
def test_adamw_matches_float64(zops, n, gdt, lp_dt, wd, step, grad_scale):
    hp = _hp(wd, step, grad_scale)
    if n == "offset1":
        # Every array starts one element into its buffer: 16-byte vectors after a 7-element
        # head on the vector path.
        _run_and_check(zops, 4099, gdt, lp_dt, hp, offsets=(1, 1, 1, 1, 1))
    else:
        _run_and_check(zops, n, gdt, lp_dt, hp)


@pytest.mark.parametrize("lp_dt", LP_DTYPES, ids=str)
@pytest.mark.parametrize("gdt", DTYPES, ids=str)
@pytest.mark.parametrize("n", (5, 4099, 65539))
def test_adamw_unreconcilable_alignment_uses_scalar_path(zops, n, gdt, lp_dt):
    # param, exp_avg, exp_avg_sq at 4, 8 and 12 bytes past 16-byte boundaries: no common head
    # length aligns them all, so the kernel must take its element-wise path.
    _run_and_check(zops, n, gdt, lp_dt, _hp(0.1, 1000, 1024.0), offsets=(1, 3, 2, 3, 1))


@pytest.mark.parametrize("gdt", DTYPES, ids=str)
def test_adamw_large_weight_lerp_branch(zops, gdt):
    # beta1 = 0.3: w = 1 - beta1 >= 0.5 takes lerp's g - (g-m)*(1-w) form.
    _run_and_check(zops, 65539, gdt, torch.bfloat16, _hp(0.1, 1000, 1.0, beta1=0.3))


@pytest.mark.slow
def test_adamw_and_sq_norm_beyond_int32(zops):
    n = 2**31 + 5
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip(f"needs 40 GiB free GPU memory, {free / 2**30:.1f} GiB free")
    hp = _hp(0.1, 1000, 1024.0)
    torch.manual_seed(0)
    param = torch.randn(n, device=DEV)
    grad = torch.randn(n, device=DEV, dtype=torch.bfloat16).mul_(1024)
    m = torch.randn(n, device=DEV).mul_(0.1)
    v = torch.rand(n, device=DEV).mul_(0.01)
    lp = torch.empty(n, device=DEV, dtype=torch.bfloat16)
    # The first elements, the int32 boundary and the very end (n - 1 = 2**31 + 4).
    idx = torch.cat([torch.arange(0, 64), torch.arange(2**31 - 64, n)]).to(DEV)
    ref_p, ref_m, ref_v = _adamw_ref64(param[idx], grad[idx], m[idx], v[idx], adam_scalars(**hp))
    _call_adamw(zops, param, grad, m, v, lp, hp)
    torch.cuda.synchronize()
    _close(param[idx], ref_p, "param")
    _close(m[idx], ref_m, "exp_avg")
    _close(v[idx], ref_v, "exp_avg_sq", atol_scale=1e-3)
    assert torch.equal(_bits(lp[idx]), _bits(param[idx].to(torch.bfloat16)))
    del param, m, v, lp

    ref = sum(c.double().square().sum() for c in grad.split(2**28)).item()
    out = zops.sq_norm(grad, backend="cuda").item()
    assert out == pytest.approx(ref, rel=1e-4)


# ---- sq_norm ------------------------------------------------------------------------------


def _sq_input(n, dtype, offset=0, seed=1):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return _flat(n + offset + 1, offset, n, dtype, torch.randn(n, generator=gen) * 3)


@pytest.mark.parametrize("offset", (0, 1, 3))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", (0, 1, 7, 4099, 65539, 1_000_003))
def test_sq_norm_matches_float64(zops, n, dtype, offset):
    t = _sq_input(n, dtype, offset)
    out = zops.sq_norm(t, backend="cuda")
    assert out.dtype == torch.float32 and out.numel() == 1
    ref = t.double().square().sum().item()
    rtol, atol = SQ_NORM
    assert out.item() == pytest.approx(ref, rel=rtol, abs=atol)
    # Deterministic: a second call gives the same bits.
    again = zops.sq_norm(t, backend="cuda")
    assert torch.equal(_bits(out.reshape(1)), _bits(again.reshape(1)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", (5, 4099, 65539))
@pytest.mark.parametrize("offset", (0, 1))
def test_sq_norm_propagates_inf_and_nan(zops, n, dtype, offset):
    # Head (offset 1), vector body and tail positions.
    for pos in {0, n // 2, n - 1}:
        t = _sq_input(n, dtype, offset)
        t[pos] = float("inf")
        assert zops.sq_norm(t, backend="cuda").item() == float("inf"), pos
        t[pos] = float("-inf")
        assert zops.sq_norm(t, backend="cuda").item() == float("inf"), pos
        t[pos] = float("nan")
        assert torch.isnan(zops.sq_norm(t, backend="cuda")).item(), pos
        t[(pos + 1) % n] = float("inf")  # inf + nan is nan, not inf
        assert torch.isnan(zops.sq_norm(t, backend="cuda")).item(), pos


def test_sq_norm_overflows_to_inf(zops):
    # 1e20**2 is beyond fp32: the fp32 result must be inf, never clamped.
    t = torch.full((4099,), 1e20, device=DEV)
    assert zops.sq_norm(t, backend="cuda").item() == float("inf")


# ---- flatten / unflatten ------------------------------------------------------------------

# Odd sizes, one well above the 64 KiB chunk, so that chunks and segments start at every
# byte phase relative to 16.
FLAT_SIZES = (1, 3, 7, 4099, 33, 100_003, 2, 65539, 5)


@pytest.mark.parametrize("out_offset", (0, 1, 2))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flatten_round_trip_exact(zops, dtype, out_offset):
    gen = torch.Generator(device="cpu").manual_seed(2)
    src = [(torch.randn(k, generator=gen) * 100).to(dtype).to(DEV).reshape(-1) for k in FLAT_SIZES]
    # 2-D and sliced sources too: any contiguous tensor may be flattened.
    src.append((torch.randn(37, 41, generator=gen)).to(dtype).to(DEV))
    big = torch.randn(1001, generator=gen).to(dtype).to(DEV)
    src.append(big[3:998])
    total = sum(t.numel() for t in src)
    buf = torch.full((total + out_offset + 8,), -7.0, dtype=dtype, device=DEV)
    flat = buf[out_offset : out_offset + total]
    guard_before = buf[:out_offset].clone(), buf[out_offset + total :].clone()

    zops.flatten_into_(src, flat, backend="cuda")
    torch.cuda.synchronize()
    expect = torch.cat([t.reshape(-1) for t in src])
    assert torch.equal(_bits(flat), _bits(expect))
    assert torch.equal(_bits(buf[:out_offset]), _bits(guard_before[0])), "wrote before out"
    assert torch.equal(_bits(buf[out_offset + total :]), _bits(guard_before[1])), "wrote after"

    dst = [torch.full_like(t, 3.0) for t in src]
    zops.unflatten_from_(flat, dst, backend="cuda")
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(src, dst, strict=True)):
        assert torch.equal(_bits(a.reshape(-1)), _bits(b.reshape(-1))), f"tensor {i}"


def test_flatten_unflatten_empty_and_zero_sized(zops):
    src = [torch.empty(0, device=DEV), torch.arange(5, dtype=torch.float32, device=DEV)]
    flat = torch.zeros(5, device=DEV)
    zops.flatten_into_(src, flat, backend="cuda")
    assert torch.equal(flat, src[1])
    dst = [torch.empty(0, device=DEV), torch.zeros(5, device=DEV)]
    zops.unflatten_from_(flat, dst, backend="cuda")
    assert torch.equal(dst[1], src[1])
