"""The fused CUDA kernel of the compressed AdamW step (csrc/adam_compressed_cuda.cu).

Oracle: ``fused_adamw_compressed_(..., backend="torch")`` on CPU copies of the same inputs, the
range contract's pure-PyTorch reference (zerokern/ops/adamw_compressed.py). The kernel must
equal it bit for bit: codes exactly, every float output with the same bit pattern, except that
a NaN equals any NaN (a GPU writes its canonical NaN where the CPU propagates payloads and
signs). The stochastically rounded bf16 param is compared exactly, NaN included: the contract
fixes its NaN to 0x7FC0.

Inputs cover every moment format x param mode x grad dtype x lerp branch, and block by block
the values a kernel gets wrong first: zeros and -0.0, subnormals, values that overflow, one
outlier per block, NaN/inf gradients, magnitudes over eight decades, NaN/inf state, values on
the 8-bit maps' decision thresholds, unaligned views (the element-wise path) and a range past
2**31 elements. ``int8v3`` is the int8 format version 3 (zerokern.quant.fmt_v3, computed maps)
through the same inputs, plus the chained cases of test_compressed_format_v3.py (the CPU and
Triton kernels' v3 cases) on the device. Every test carries the ``gpu`` marker (conftest.py
skips it without CUDA) and is skipped when zerokern._C has no CUDA kernels.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch
from test_compressed_format_v3 import CASES as V3_CASES
from test_compressed_format_v3 import chained_vs_oracle

from zerokern.quant.fmt_v3 import quantize_blockwise_v3
from zerokern.quant.maps import (
    BLOCK,
    SIGNED_MAP_ID,
    UNSIGNED_MAP_ID,
    code_map,
    decision_thresholds,
    quantize_blockwise,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
MOMENTS = ("fp32", "bf16", "int8", "int8v3")  # int8v3: format_version=3
# param mode: fp32 master alone, with a bf16 / fp16 param_lp, or the bf16 param itself (SR)
PARAMS = ("fp32", "fp32+bf16", "fp32+fp16", "bf16")
GRADS = (torch.float32, torch.bfloat16, torch.float16)
BETA1 = (0.9, 0.2)  # w = 1 - beta1 = 0.1 < 0.5 and 0.8 >= 0.5: both forms of torch's lerp
COMBOS = list(product(MOMENTS, PARAMS, GRADS, BETA1))
SEEDS = (2**64 - 12345, 42)  # one with the high key word >= 2**31, one small
STEPS = (1, 7, 3_000_000_001)  # the last one >= 2**31: the Philox counter word is uint32
STYLES = 9  # block styles of _styled


@pytest.fixture(scope="module")
def zops():
    from zerokern import _native

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not _native.has_cuda_kernels():
        pytest.skip("zerokern._C is not built with CUDA kernels")
    import zerokern.ops.adamw_compressed

    return zerokern.ops.adamw_compressed


# ---- inputs -------------------------------------------------------------------------------


def _styled(n: int, shift: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """fp32 p, g, m, v of n elements whose 256-blocks take style (block + shift) % STYLES."""
    def rnd(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(n, generator=gen) * scale

    def uni() -> torch.Tensor:
        return torch.rand(n, generator=gen)

    i = torch.arange(n)
    style = (i // BLOCK + shift) % STYLES
    sign = torch.where(uni() < 0.5, -1.0, 1.0)
    out = {"p": rnd(), "g": rnd() * torch.exp(rnd(2.0)), "m": rnd(0.1), "v": uni() * 0.01}

    def put(s: int, **vals: torch.Tensor) -> None:
        for k, x in vals.items():
            out[k] = torch.where(style == s, x, out[k])

    # 0: typical values (above). 1: zeros, with -0.0 in places
    z = torch.where(i % 3 == 0, -0.0, 0.0)
    put(1, p=z, g=z, m=z, v=torch.zeros(n))
    # 2: subnormals only (fp32's smallest normal is 1.18e-38)
    put(2, p=sign * uni() * 1e-39, g=-sign * uni() * 1e-39, m=sign * uni() * 1e-40,
        v=uni() * 1e-41)
    # 3: huge: g*g and the v update overflow to inf, p and m near fp32's largest
    put(3, p=sign * (1 + uni()) * 1.5e38, g=sign * (1 + uni()) * 1e30, m=-sign * uni() * 3e38,
        v=uni() * 3e38)
    # 4: small values and one outlier per block (in g, m and v)
    outlier = (i % BLOCK) == ((i // BLOCK) * 37 + 11) % BLOCK
    small = rnd(1e-3)
    put(4, g=torch.where(outlier, 1e4, small), m=torch.where(outlier, -1e4, small),
        v=torch.where(outlier, 1e8, small.abs()))
    # 5: NaN and +-inf gradients in an otherwise typical block
    put(5, g=torch.where(i % 97 == 5, float("nan"), torch.where(
        i % 89 == 7, float("inf"), torch.where(i % 83 == 3, float("-inf"), out["g"]))))
    # 6: magnitudes over eight decades: every exponent of the dynamic maps gets codes
    put(6, g=sign * 10 ** (-8 * uni()), m=-sign * 10 ** (-8 * uni()), v=10 ** (-8 * uni()))
    # 7: non-finite state (int8 state gets NaN/inf absmax in _state)
    put(7, m=torch.where(i % 50 == 1, float("inf"), out["m"]),
        v=torch.where(i % 60 == 2, float("nan"), out["v"]))
    # 8: p near the top of bf16's range (param_lp's RNE overflows) and subnormal moments
    #    next to one normal value per block (relative sizes far below the maps' resolution)
    put(8, p=sign * (3.38e38 + uni() * 2e36), m=torch.where(outlier, 1.0, sign * 1e-40),
        v=torch.where(outlier, 1.0, uni() * 1e-42))
    return out


def _state(mfmt: str, m: torch.Tensor, v: torch.Tensor, shift: int,
           gen: torch.Generator) -> dict[str, torch.Tensor | int | None]:
    """The moments in format mfmt, with the op's format_version (an int, not a tensor)."""
    if mfmt == "fp32":
        return {"exp_avg": m.clone(), "exp_avg_sq": v.clone(), "exp_avg_absmax": None,
                "exp_avg_sq_absmax": None, "format_version": 2}
    if mfmt == "bf16":
        return {"exp_avg": m.bfloat16(), "exp_avg_sq": v.bfloat16(), "exp_avg_absmax": None,
                "exp_avg_sq_absmax": None, "format_version": 2}
    if mfmt == "int8v3":
        cm, am = quantize_blockwise_v3(m, True)
        cv, av = quantize_blockwise_v3(v, False)
    else:
        cm, am = quantize_blockwise(m, code_map(SIGNED_MAP_ID))
        cv, av = quantize_blockwise(v, code_map(UNSIGNED_MAP_ID))
    nb = am.numel()
    odd = (torch.arange(nb) + shift) % STYLES == 7  # style-7 blocks: NaN / inf absmax
    am = torch.where(odd, float("nan"), am)
    av = torch.where(odd, float("inf"), av)
    return {"exp_avg": cm, "exp_avg_sq": cv, "exp_avg_absmax": am, "exp_avg_sq_absmax": av,
            "format_version": 3 if mfmt == "int8v3" else 2}


def _inputs(n: int, mfmt: str, pmode: str, gdt: torch.dtype, shift: int, seed: int
            ) -> dict[str, torch.Tensor | int | None]:
    """CPU tensors of one range: param, grad, the state, param_lp and sr_index."""
    gen = torch.Generator().manual_seed(seed)
    x = _styled(n, shift, gen)
    args: dict[str, torch.Tensor | None] = {
        "param": x["p"].bfloat16() if pmode == "bf16" else x["p"],
        "grad": x["g"].to(gdt),
        **_state(mfmt, x["m"], x["v"], shift, gen),
        "param_lp": None,
        "sr_index": None,
    }
    if pmode.startswith("fp32+"):
        lp_dt = torch.bfloat16 if pmode.endswith("bf16") else torch.float16
        args["param_lp"] = torch.randn(n, generator=gen).to(lp_dt)  # overwritten
    if pmode == "bf16":
        # unrelated parameters' indices per block, each leaving room for 256 elements
        nb = -(-n // BLOCK)
        args["sr_index"] = torch.randint(0, 2**32 - BLOCK + 1, (nb,), generator=gen,
                                         dtype=torch.int64)
    return args


def _new_grad(n: int, gdt: torch.dtype, shift: int, seed: int) -> torch.Tensor:
    return _styled(n, shift, torch.Generator().manual_seed(seed))["g"].to(gdt)


def _hp(beta1: float, step: int, grad_scale: float) -> dict:
    return dict(lr=1e-2, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step,
                grad_scale=grad_scale)


# ---- comparison ---------------------------------------------------------------------------

_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _assert_same(name: str, got: torch.Tensor, want: torch.Tensor, exact_nan: bool = False
                 ) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype)
    if not want.dtype.is_floating_point:
        eq = got == want
    else:
        eq = got.view(_INT[want.dtype]) == want.view(_INT[want.dtype])
        if not exact_nan:
            eq |= got.isnan() & want.isnan()
    if not bool(eq.all()):
        bad = (~eq).nonzero().flatten()
        first = bad[:6]
        raise AssertionError(
            f"{name}: {bad.numel()} of {want.numel()} differ; at {first.tolist()} "
            f"cuda {got[first].tolist()} vs torch {want[first].tolist()}")


OUTPUTS = ("param", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax", "param_lp")


def _step_both(zops, dev_args: dict, ref_args: dict, hp: dict, seed: int | None) -> None:
    """One step of the CUDA kernel on dev_args and of the torch oracle on ref_args (CPU),
    then every output compared."""
    grad_dev = dev_args["grad"].clone()
    zops.fused_adamw_compressed_(**dev_args, **hp, seed=seed, backend="cuda")
    zops.fused_adamw_compressed_(**ref_args, **hp, seed=seed, backend="torch")
    torch.cuda.synchronize()
    for k in OUTPUTS:
        if ref_args[k] is not None:
            sr = k == "param" and ref_args[k].dtype == torch.bfloat16
            _assert_same(k, dev_args[k], ref_args[k], exact_nan=sr)
    _assert_same("grad (read only)", dev_args["grad"], grad_dev.cpu(), exact_nan=True)


def _to_dev(args: dict) -> dict:
    return {k: t.to(DEV, copy=True) if isinstance(t, torch.Tensor) else t
            for k, t in args.items()}


def _run(zops, n: int, mfmt: str, pmode: str, gdt: torch.dtype, beta1: float, idx: int,
         steps: int) -> None:
    shift = idx % STYLES
    ref = _inputs(n, mfmt, pmode, gdt, shift, seed=idx)
    dev = _to_dev(ref)
    # idx's bit 0 is the lerp form in COMBOS: vary seed and grad scale on other bits
    seed = SEEDS[(idx // 4) % 2] if pmode == "bf16" else None
    grad_scale = (1.0, 3.0)[(idx // 2) % 2]  # 1/3 is inexact in fp32
    for t in range(steps):
        if t:
            ref["grad"] = _new_grad(n, gdt, shift + t, seed=1000 + idx + t)
            dev["grad"] = ref["grad"].to(DEV, copy=True)
        _step_both(zops, dev, ref, _hp(beta1, STEPS[idx % 3] + t, grad_scale), seed)


# ---- tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", (1, 255, 257, 9 * BLOCK + 31))
@pytest.mark.parametrize("idx", range(len(COMBOS)),
                         ids=[f"{m}-{p}-g{str(g)[6:]}-b{b}" for m, p, g, b in COMBOS])
def test_cuda_equals_torch(zops, idx, n):
    """Two steps (the second from the first's outputs); small ranges see the block style
    the combination's index selects, 9*256+31 sees every style and a partial last block."""
    mfmt, pmode, gdt, beta1 = COMBOS[idx]
    _run(zops, n, mfmt, pmode, gdt, beta1, idx, steps=2)


@pytest.mark.parametrize("mfmt, pmode", list(product(MOMENTS, ("fp32+fp16", "bf16"))))
def test_cuda_equals_torch_large(zops, mfmt, pmode):
    """2**20 + 3 elements (4097 blocks, every style hundreds of times, hundreds of thread
    blocks), one step; the fp32 master with a 16-bit copy and the bf16 param (the small
    ranges above cover every param mode), grad dtype and lerp form varying."""
    idx = MOMENTS.index(mfmt) * 2 + (pmode == "bf16")
    _run(zops, 2**20 + 3, mfmt, pmode, GRADS[idx % 3], BETA1[idx % 2], idx, steps=1)


@pytest.mark.parametrize("pmode", ("fp32", "bf16"))
def test_values_on_decision_thresholds(zops, pmode):
    """beta1 = 0 makes the new exp_avg the gradient itself (lerp with w = 1: g - (g-m)*0), so
    the blocks can put x / absmax exactly on every threshold of the signed map: block 0 is
    2 * t_k with absmax 2, block 1 its negation. Ties go to the code of smaller magnitude."""
    t = decision_thresholds(code_map(SIGNED_MAP_ID))
    blk = torch.cat([torch.tensor([2.0]), 2 * t])
    g = torch.cat([blk, -blk, blk[:100] * 0.5])  # block 2: partial, absmax 1
    n = g.numel()
    gen = torch.Generator().manual_seed(5)
    m = torch.randn(n, generator=gen)
    v = torch.rand(n, generator=gen)
    ref = {"param": torch.randn(n, generator=gen), "grad": g,
           **_state("int8", m, v, shift=0, gen=gen), "param_lp": None, "sr_index": None}
    seed = None
    if pmode == "bf16":
        ref["param"] = ref["param"].bfloat16()
        ref["sr_index"] = torch.tensor([0, 256, 512], dtype=torch.int64)
        seed = 7
    dev = _to_dev(ref)
    hp = dict(lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0, step=3,
              grad_scale=1.0)
    _step_both(zops, dev, ref, hp, seed)
    # and the tie rule itself, independently of the oracle: n = t_k > 0 -> code k and
    # n = t_k < 0 -> code k + 1, the neighbour nearer zero either way
    codes = dev["exp_avg"][1:BLOCK].cpu().long()
    k = torch.arange(BLOCK - 1)
    assert torch.equal(codes, torch.where(t < 0, k + 1, k))


@pytest.mark.parametrize("pmode", ("fp32", "bf16"))
def test_v3_midpoints_and_every_code(zops, pmode):
    """Format version 3. beta1 = 0 makes the new exp_avg the gradient itself, so with a 1.0
    in each block (absmax 1) n is exactly g: the blocks put n on every midpoint between the
    signed map's values (ties go away from zero), one fp32 step either side, and their
    negations. The state starts from random codes (every code of both maps, code 0 of the
    signed map decoding to -1.125) under random, zero and subnormal scales."""
    from zerokern.quant.fmt_v3 import code_map_v3

    t = code_map_v3(True)[1:].double()  # -1.0 ... 1.0
    mids = ((t[1:] + t[:-1]) / 2).float()
    one = torch.tensor([1.0])
    blocks = []
    for x in (mids, torch.nextafter(mids, torch.tensor(2.0)),
              torch.nextafter(mids, torch.tensor(-2.0))):
        for sign in (1.0, -1.0):
            blocks.append(torch.cat([one, sign * x, torch.zeros(BLOCK - 1 - x.numel())]))
    g = torch.cat(blocks + [blocks[0][:77]])  # and a partial last block
    n = g.numel()
    nb = -(-n // BLOCK)
    gen = torch.Generator().manual_seed(6)
    scales = torch.rand(nb, generator=gen)
    scales[1], scales[2] = 0.0, 2.0**-140
    ref = {"param": torch.randn(n, generator=gen), "grad": g,
           "exp_avg": torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
           "exp_avg_sq": torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
           "exp_avg_absmax": scales.clone(), "exp_avg_sq_absmax": scales.flip(0) * 1e-3,
           "param_lp": None, "sr_index": None, "format_version": 3}
    seed = None
    if pmode == "bf16":
        ref["param"] = ref["param"].bfloat16()
        ref["sr_index"] = torch.arange(nb, dtype=torch.int64) * BLOCK
        seed = 7
    dev = _to_dev(ref)
    hp = dict(lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0, step=3,
              grad_scale=1.0)
    _step_both(zops, dev, ref, hp, seed)
    # the tie rule itself, independently of the oracle: the midpoint between codes k + 1 and
    # k + 2 goes away from zero (k + 2 when positive, k + 1 when negative), except the two
    # around 0, below the smallest magnitude, which truncate to 0 (code 128)
    codes = dev["exp_avg"][1 : 1 + mids.numel()].cpu().long()
    k = torch.arange(mids.numel())
    want = torch.where(mids > 0, k + 2, k + 1)
    want = torch.where(mids.abs() < 1.25 * 2.0**-16, 128, want)
    assert torch.equal(codes, want), (codes != want).nonzero()[:8]


@pytest.mark.parametrize("mfmt", MOMENTS)
def test_stochastic_rounding_saturates_at_the_top_of_bf16(zops, mfmt):
    """lr = eps = 1, no weight decay, g = v = 0 and a step so late that both bias corrections
    are 1: the update is p - m_new, one rounding, with p = +-(bf16's largest finite value)
    and m_new up to 2e36 the other way. fp32 results above bf16's largest must saturate to it
    (0x7F7F), those that overflow fp32 itself are inf (SR keeps an inf)."""
    n = 2 * BLOCK + 17
    gen = torch.Generator().manual_seed(8)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    top = torch.tensor([0x7F7F], dtype=torch.int16).view(torch.bfloat16).float()
    m = -sign * torch.rand(n, generator=gen) * 2.4e36
    ref = {"param": (sign * top).bfloat16(), "grad": torch.zeros(n),
           **_state(mfmt, m, torch.zeros(n), shift=0, gen=gen), "param_lp": None,
           "sr_index": torch.arange(3, dtype=torch.int64) * BLOCK}
    dev = _to_dev(ref)
    hp = dict(lr=1.0, beta1=0.9, beta2=0.999, eps=1.0, weight_decay=0.0, step=3_000_000_000,
              grad_scale=1.0)
    _step_both(zops, dev, ref, hp, SEEDS[1])
    mag = dev["param"].cpu().view(torch.int16) & 0x7FFF
    assert bool(((mag == 0x7F7F) | (mag == 0x7F80)).all())
    assert bool((mag == 0x7F7F).sum() > n // 4) and bool((mag == 0x7F80).sum() > n // 8)


@pytest.mark.parametrize("mfmt, pmode", list(product(MOMENTS, PARAMS)))
def test_unaligned_views_and_no_writes_outside(zops, mfmt, pmode):
    """Every array one element into a larger buffer (16-bit and uint8 arrays then sit off
    their vector alignment): the element-wise path. The buffers' other elements keep their
    bits."""
    n = 3 * BLOCK + 5
    idx = MOMENTS.index(mfmt) * len(PARAMS) + PARAMS.index(pmode)
    ref = _inputs(n, mfmt, pmode, torch.bfloat16, shift=idx, seed=77 + idx)
    bufs, dev = {}, {}
    for k, x in ref.items():
        if not isinstance(x, torch.Tensor):  # None, format_version
            dev[k] = x
            continue
        # a sentinel bit pattern 0x5A5A... around the range
        ity = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[x.element_size()]
        buf = torch.full((x.numel() + 3,), int("5A" * x.element_size(), 16),
                         dtype=ity).view(x.dtype)
        buf[1 : x.numel() + 1] = x
        bufs[k] = (buf.to(DEV, copy=True), buf.clone())
        dev[k] = bufs[k][0][1 : x.numel() + 1]
    seed = SEEDS[0] if pmode == "bf16" else None
    _step_both(zops, dev, ref, _hp(0.9, 5, 1.0), seed)
    for k, (buf, before) in bufs.items():
        got = buf.cpu()
        for part in (slice(0, 1), slice(got.numel() - 2, got.numel())):
            _assert_same(f"{k} outside the range", got[part], before[part], exact_nan=True)


@pytest.mark.parametrize("case", range(len(V3_CASES)))
def test_v3_chained_cases(zops, case):
    """test_compressed_format_v3's chained cases (every param mode, partial blocks, subnormal
    and zero scales, an inf block and the NaN block it decodes to) on the device."""
    chained_vs_oracle("cuda", *V3_CASES[case], device=DEV)


def _check_blocks_of_a_long_range(zops, n: int, picks: list[int]) -> None:
    """Random int8 state, bf16 param and grad over n elements on the device, one step; the
    picked blocks equal the oracle run on each block alone (blocks are independent, and
    sr_index carries each block's position)."""
    nb = -(-n // BLOCK)
    gen = torch.Generator(device=DEV).manual_seed(0)
    dev = {
        "param": torch.randn(n, generator=gen, device=DEV, dtype=torch.bfloat16),
        "grad": torch.randn(n, generator=gen, device=DEV, dtype=torch.bfloat16),
        "exp_avg": torch.randint(0, 256, (n,), generator=gen, device=DEV, dtype=torch.uint8),
        "exp_avg_sq": torch.randint(0, 256, (n,), generator=gen, device=DEV,
                                    dtype=torch.uint8),
        "exp_avg_absmax": torch.rand(nb, generator=gen, device=DEV),
        "exp_avg_sq_absmax": torch.rand(nb, generator=gen, device=DEV) * 1e-3,
        "param_lp": None,
        "sr_index": torch.arange(nb, device=DEV, dtype=torch.int64) * BLOCK,
    }
    per_elem = ("param", "grad", "exp_avg", "exp_avg_sq")
    refs = []
    for b in picks:
        lo, hi = b * BLOCK, min(n, (b + 1) * BLOCK)
        refs.append({k: None if t is None else
                     (t[lo:hi] if k in per_elem else t[b : b + 1]).to("cpu", copy=True)
                     for k, t in dev.items()})
    hp = _hp(0.9, 11, 1.0)
    zops.fused_adamw_compressed_(**dev, **hp, seed=SEEDS[0], backend="cuda")
    torch.cuda.synchronize()
    for b, ref in zip(picks, refs):
        zops.fused_adamw_compressed_(**ref, **hp, seed=SEEDS[0], backend="torch")
        lo, hi = b * BLOCK, min(n, (b + 1) * BLOCK)
        for k in ("param", "exp_avg", "exp_avg_sq"):
            _assert_same(f"{k} block {b}", dev[k][lo:hi], ref[k], exact_nan=k == "param")
        for k in ("exp_avg_absmax", "exp_avg_sq_absmax"):
            _assert_same(f"{k} block {b}", dev[k][b : b + 1], ref[k])


@pytest.mark.slow
def test_range_beyond_int32(zops):
    """2**31 + 300 elements (about 13 GiB): the blocks at the start, on both sides of element
    2**31, in the middle and at the end. With 8.4M blocks every warp strides over thousands
    of them."""
    n = 2**31 + 300
    free, _ = torch.cuda.mem_get_info()
    if free < 16 * 2**30:
        pytest.skip(f"needs 16 GiB free GPU memory, {free / 2**30:.1f} GiB free")
    nb = -(-n // BLOCK)
    # element 2**31 starts block 2**23
    picks = [0, 1, 4223, 4224, 2**23 - 1, 2**23, nb // 2 + 7, nb - 2, nb - 1]
    _check_blocks_of_a_long_range(zops, n, picks)
