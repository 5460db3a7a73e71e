"""The block quantization codec of the quantized collectives (zerokern/quant/comm_codec.py, the
oracle, and its ops zerokern.ops.quantize_blocks_ / dequantize_blocks_).

Every value is checked against float64 arithmetic written here, not against the oracle itself:
the scale is the correctly rounded absmax / L, the codes are round-half-even of the correctly
rounded, clamped x / s, the decoded value is the correctly rounded q * s (exact in float64),
saturated at fp32's largest value (a finite block never decodes to inf), and |decoded - x|
stays within the bound derived in the module docstring, for fp32/bf16/fp16 inputs, odd sizes,
several segments, adversarial blocks (ties, the block's own absmax, subnormal and underflowing
scales, fp32's largest values) and random ones (hypothesis). Non-finite blocks decode to the
canonical NaN, other blocks untouched. The Triton kernels are compared with this oracle bit for
bit in test_triton_comm_quant.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from zerokern import formulas
from zerokern.ops import dequantize_blocks_, quantize_blocks_
from zerokern.quant import comm_codec as cc

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ETA = 2.0**-149
U = 2.0**-24
FLT_MAX = torch.finfo(torch.float32).max


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _f32(x64: torch.Tensor) -> torch.Tensor:
    """float64 -> fp32 rounded to nearest even (one rounding)."""
    return x64.to(torch.float32)


def _reference(x: torch.Tensor, segments: int, bits: int, block: int):
    """(scales, codes, decoded fp32) from float64 arithmetic, segment by segment."""
    lv = cc.LEVELS[bits]
    n = x.numel() // segments
    scales, codes, ys = [], [], []
    for seg in x.double().reshape(segments, n):
        for start in range(0, n, block):
            v = seg[start:start + block]
            if not torch.isfinite(v).all():
                scales.append(torch.tensor([math.nan]))
                codes.append(torch.zeros(v.numel(), dtype=torch.int32))
                ys.append(torch.full((v.numel(),), math.nan))
                continue
            a = v.abs().max()
            # fp64 division then fp32 rounding: double rounding is innocuous for a quotient
            # of fp32 values (53 >= 2 * 24 + 2), so this is the correctly rounded a / L.
            s = _f32(a / lv).double()
            t = _f32(v / (s if s != 0 else 1.0)).double().clamp(-lv, lv)
            q = torch.round(t).to(torch.int64).double()  # half to even; integers: no -0
            scales.append(s.reshape(1).float())
            codes.append(q.to(torch.int32))
            # q * s is exact in float64; one rounding to fp32, saturated at fp32's largest
            ys.append(_f32(q * s).clamp(-FLT_MAX, FLT_MAX).double())
    return torch.cat(scales), torch.cat(codes), torch.cat(ys)


def _bound(x: torch.Tensor, segments: int, bits: int, block: int) -> torch.Tensor:
    lv = cc.LEVELS[bits]
    n = x.numel() // segments
    a = torch.cat([seg[i:i + block].abs().max().expand(len(seg[i:i + block]))
                   for seg in x.double().reshape(segments, n) for i in range(0, n, block)])
    return a / (2 * lv) + a * 2.0**-22 + (lv + 1) / 2 * ETA


def _check(x: torch.Tensor, segments: int, bits: int, block: int) -> None:
    n = x.numel() // segments
    payload = cc.quantize(x, segments, bits, block)
    assert payload.dtype == torch.uint8
    assert payload.numel() == segments * formulas.quantized_payload_bytes(n, bits, block)
    scales, codes = cc.split_payload(payload, n, segments, bits, block)
    rs, rq, ry = _reference(x, segments, bits, block)
    assert torch.equal(_bits(scales.reshape(-1)), _bits(rs)), "scales"
    assert torch.equal(codes.reshape(-1), rq), "codes"
    y = cc.dequantize(payload, n, segments, bits, block)
    assert y.dtype == torch.float32
    assert torch.equal(_bits(y), _bits(_f32(ry))), "decoded values"
    finite = torch.isfinite(ry)
    err = (y.double() - x.double()).abs()
    bound = _bound(x, segments, bits, block)
    assert (err[finite] <= bound[finite]).all(), (err - bound)[finite].max()
    assert torch.isnan(y[~finite]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [16, 256])
@pytest.mark.parametrize("n,segments", [(1, 1), (37, 3), (256, 2), (513, 1), (1000, 4)])
def test_random_against_float64(dtype, bits, block, n, segments):
    g = torch.Generator().manual_seed(n * 7 + segments)
    scale = torch.logspace(-6, 6, n * segments, dtype=torch.float64)[torch.randperm(
        n * segments, generator=g)]
    x = (torch.randn(n * segments, generator=g, dtype=torch.float64) * scale).to(dtype)
    _check(x, segments, bits, block)


def _adversarial_blocks(block: int, lv: int) -> dict[str, torch.Tensor]:
    """Blocks (fp32, ``block`` elements) that sit on the edges of each step."""
    ar = torch.arange(block, dtype=torch.float64)
    s = 0.5  # a power of two: x = (k + 1/2) s is an exact tie of x / s
    ties = ((ar % (2 * lv + 1)) - lv + 0.5).clamp(-lv, lv) * s
    ties[0] = lv * s  # the absmax makes the scale exactly s
    return {
        "zeros": torch.zeros(block),
        "minus zeros": torch.full((block,), -0.0),
        "one nonzero": torch.nn.functional.pad(torch.tensor([3.0]), (block - 1, 0)),
        "plus and minus absmax": torch.where(ar % 2 == 0, 1.5, -1.5).float(),
        "ties to even": ties.float(),
        "absmax only negative": -torch.linspace(0, 2.0, block),
        "largest fp32": torch.full((block,), 3.4028234663852886e38) * torch.where(
            ar % 3 == 0, 1.0, -0.75).float(),
        "smallest normals": torch.linspace(-2.0**-126, 2.0**-126, block),
        "subnormals": (ar - block // 2).float() * ETA,
        # the scale underflows to 0 (a <= L * 2**-150): codes 0, exact enough
        "scale underflows": torch.tensor([(lv // 2) * ETA, -ETA] * (block // 2)),
        # a subnormal scale rounded down: x / s > L, clamped
        "subnormal scale rounded down": torch.tensor([(3 * lv // 2) * ETA] * block),
        "scale at the normal boundary": torch.full((block,), lv * 2.0**-126)
        * torch.where(ar % 2 == 0, 1.0, -1 / 3).float(),
        "tiny next to large": torch.tensor([1e30] + [1e-30] * (block - 1)),
    }


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [16, 64])
def test_adversarial_blocks(bits, block):
    for name, blk in _adversarial_blocks(block, cc.LEVELS[bits]).items():
        try:
            _check(blk.float(), 1, bits, block)
            # Partial and several segments: the block restarts at each segment.
            x = torch.cat([blk[: block - 3], -blk[: block - 3]]).float()
            _check(x, 2, bits, block)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_extremes(dtype):
    info = torch.finfo(dtype)
    x = torch.tensor([info.max, -info.max, info.tiny, info.smallest_normal / 4, 0.0, 1.0] * 6,
                     dtype=dtype)
    _check(x, 1, 8, 16)
    _check(x, 2, 4, 16)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_nonfinite_block_decodes_to_nan(bad, bits, out_dtype):
    block, n = 16, 53
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * n, generator=g)
    clean = cc.dequantize(cc.quantize(x, 2, bits, block), n, 2, bits, block, dtype=out_dtype)
    x[n + 20] = bad  # segment 1, block 1 (elements 16..31 of the segment)
    p = cc.quantize(x, 2, bits, block)
    scales, codes = cc.split_payload(p, n, 2, bits, block)
    assert torch.isnan(scales[1, 1]) and _bits(scales[1, 1:2]).item() == 0x7FC00000
    assert (codes[1, 16:32] == 0).all()
    y = cc.dequantize(p, n, 2, bits, block, dtype=out_dtype)
    hit = torch.zeros(2 * n, dtype=torch.bool)
    hit[n + 16:n + 32] = True
    nan = _bits(torch.tensor([cc.NAN_BITS[out_dtype]]).to(_bits(y).dtype)).view(out_dtype)
    assert torch.equal(_bits(y[hit]), _bits(nan.expand(16))), "canonical NaN"
    assert torch.equal(_bits(y[~hit]), _bits(clean[~hit])), "other blocks unchanged"
    red = cc.dequantize(p, n, 2, bits, block, reduce=True, dtype=out_dtype)
    assert torch.isnan(red[16:32]).all() and not torch.isnan(red[:16]).any()
    assert torch.equal(_bits(red[16:32]), _bits(nan.expand(16)))


def test_int4_layout_and_padding():
    # Two blocks of 16 (the second partial: 5 elements), absmax 7 -> scale 1, codes = x.
    x = torch.tensor([float(v) for v in range(-7, 8)] + [0.0, 7.0, -1.0, 2.0, 0.0, -3.0])
    p = cc.quantize(x, 1, 4, 16)
    assert p.numel() == 2 * 4 + 12  # 2 scales, ceil(21 / 2) = 11 code bytes + 1 pad
    assert torch.equal(p[:8].view(torch.float32), torch.tensor([1.0, 1.0]))
    codes = [int(v) for v in x]
    nib = [c & 0xF for c in codes] + [0]
    expect = [nib[2 * j] | (nib[2 * j + 1] << 4) for j in range(11)] + [0]
    assert p[8:].tolist() == expect
    p8 = cc.quantize(x, 1, 8, 16)
    scale0 = float(torch.tensor(7.0) / 127)
    assert p8.numel() == 8 + 24 and p8[8 + 21:].tolist() == [0, 0, 0]
    assert p8[:4].view(torch.float32).item() == scale0


def test_reduce_sums_in_fp32_in_segment_order():
    g = torch.Generator().manual_seed(3)
    n, segs = 100, 4
    mags = torch.tensor([1e4, 1.0, 1e-4, 1e2]).repeat_interleave(n)
    x = torch.randn(segs * n, generator=g) * mags
    for bits in (8, 4):
        p = cc.quantize(x, segs, bits, 16)
        parts = cc.dequantize(p, n, segs, bits, 16).reshape(segs, n)
        acc = parts[0].clone()
        for i in range(1, segs):
            acc = acc + parts[i]  # fp32 adds, in order
        for dt in DTYPES:
            got = cc.dequantize(p, n, segs, bits, 16, reduce=True, dtype=dt)
            assert torch.equal(_bits(got), _bits(acc.to(dt)))


def test_property_random_blocks():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)

    @hypothesis.settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @hypothesis.given(values=st.lists(finite32, min_size=1, max_size=300),
                      block=st.sampled_from([16, 32, 256]), bits=st.sampled_from([8, 4]),
                      segments=st.sampled_from([1, 2, 3]),
                      dtype=st.sampled_from(DTYPES))
    def check(values, block, bits, segments, dtype):
        values = values[: len(values) - len(values) % segments] or [0.0] * segments
        x = torch.tensor(values, dtype=torch.float32)
        if dtype != torch.float32:
            x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
        _check(x, segments, bits, block)
        again = cc.quantize(x.clone(), segments, bits, block)
        assert torch.equal(again, cc.quantize(x, segments, bits, block))

    check()


# -- the ops ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_torch_backend_equal_oracle(bits, dtype):
    n, segs = 77, 3
    x = (torch.randn(n * segs, generator=torch.Generator().manual_seed(5)) * 10).to(dtype)
    size = segs * cc.payload_nbytes(n, bits, 32)
    payload = torch.full((size,), 0xAB, dtype=torch.uint8)
    assert quantize_blocks_(x, payload, segments=segs, bits=bits, block=32,
                            backend="torch") is payload
    assert torch.equal(payload, cc.quantize(x, segs, bits, 32))
    for out_dtype in DTYPES:
        for reduce in (False, True):
            out = torch.empty(n if reduce else n * segs, dtype=out_dtype)
            dequantize_blocks_(payload, out, segments=segs, bits=bits, block=32, reduce=reduce)
            ref = cc.dequantize(payload, n, segs, bits, 32, reduce=reduce, dtype=out_dtype)
            assert torch.equal(_bits(out), _bits(ref))


def _bad_calls():
    x = torch.randn(64)
    ok = torch.zeros(cc.payload_nbytes(64, 8, 16), dtype=torch.uint8)
    return [
        (dict(x=x, payload=ok, bits=5, block=16), ValueError, "bits"),
        (dict(x=x, payload=ok, bits=8, block=24), ValueError, "block"),
        (dict(x=x, payload=ok, bits=8, block=8), ValueError, "block"),
        (dict(x=x, payload=ok, bits=8, block=True), ValueError, "block"),
        (dict(x=x.double(), payload=ok, bits=8, block=16), TypeError, "x"),
        (dict(x=x.reshape(8, 8), payload=ok, bits=8, block=16), ValueError, "x"),
        (dict(x=x, payload=ok[:-4], bits=8, block=16), ValueError, "payload"),
        (dict(x=x, payload=ok.float(), bits=8, block=16), TypeError, "payload"),
        (dict(x=x, payload=ok, bits=8, block=16, segments=0), ValueError, "segments"),
        (dict(x=x[:63], payload=ok, bits=8, block=16, segments=2), ValueError, "segments"),
        (dict(x=x, payload=ok, bits=8, block=16, backend="cuda"), ValueError, "backend"),
        (dict(x=x, payload=ok, bits=8, block=16, backend="cpu"), ValueError, "backend"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_arguments_name_them_and_write_nothing(case):
    kwargs, exc, word = _bad_calls()[case]
    payload = kwargs["payload"]
    before = payload.clone()
    x = kwargs.pop("x")
    with pytest.raises(exc, match=word):
        quantize_blocks_(x, **kwargs)
    assert torch.equal(payload, before)


def test_dequantize_bad_arguments():
    p = cc.quantize(torch.randn(64), 2, 8, 16)
    out = torch.zeros(64)
    with pytest.raises(ValueError, match="payload"):
        dequantize_blocks_(p, out[:40], segments=2, bits=8, block=16)
    with pytest.raises(ValueError, match="payload"):
        dequantize_blocks_(p, out, segments=2, bits=4, block=16)
    with pytest.raises(TypeError, match="out"):
        dequantize_blocks_(p, out.long(), segments=2, bits=8, block=16)
    with pytest.raises(ValueError, match="out"):
        dequantize_blocks_(p, out[:63], segments=2, bits=8, block=16)
    with pytest.raises(ValueError, match="aligned"):
        big = torch.zeros(p.numel() + 1, dtype=torch.uint8)
        dequantize_blocks_(big[1:], out, segments=2, bits=8, block=16)
    assert (out == 0).all()


def test_backend_choice(monkeypatch):
    from zerokern.ops.comm_quant import _resolve

    monkeypatch.setenv("ZEROKERN_BACKEND", "cpu")  # set for the other ops: automatic here
    assert _resolve(None, torch.device("cpu")) == "torch"
    monkeypatch.setenv("ZEROKERN_BACKEND", "torch")
    assert _resolve(None, torch.device("cpu")) == "torch"
    monkeypatch.delenv("ZEROKERN_BACKEND")
    assert _resolve(None, torch.device("cpu")) == "torch"
    if "TRITON_INTERPRET" not in __import__("os").environ:
        with pytest.raises(ValueError, match="interpreter"):
            _resolve("triton", torch.device("cpu"))


def test_opcheck():
    from zerokern.ops.comm_quant import _dequantize_op, _quantize_op

    x = torch.randn(3 * 40)
    p = torch.zeros(3 * cc.payload_nbytes(40, 4, 16), dtype=torch.uint8)
    torch.library.opcheck(_quantize_op, (x, p, 3, 4, 16, "torch"))
    _quantize_op(x, p, 3, 4, 16, "torch")
    torch.library.opcheck(_dequantize_op, (p, torch.empty(40), 3, 4, 16, True, "torch"))


def test_empty_segments():
    x = torch.zeros(0)
    p = torch.zeros(0, dtype=torch.uint8)
    quantize_blocks_(x, p, segments=3)
    out = torch.full((0,), 1.0)
    dequantize_blocks_(p, out, segments=3, reduce=True)


# -- formulas ---------------------------------------------------------------------------------
def test_payload_formula_matches_codec():
    for bits in (8, 4):
        for block in (16, 256, 2048):
            for n in [*range(0, 70), 255, 256, 257, 4095, 10**6 + 3]:
                assert cc.payload_nbytes(n, bits, block) == formulas.quantized_payload_bytes(
                    n, bits, block), (n, bits, block)
    assert formulas.quantized_payload_bytes(256 * 1000, 8) / (256 * 1000) == 1 + 4 / 256
    with pytest.raises(ValueError, match="bits"):
        formulas.quantized_payload_bytes(10, 2)
    with pytest.raises(ValueError, match="world"):
        formulas.quantized_all_gather_bytes(10, 0)
    with pytest.raises(ValueError, match="multiple"):
        formulas.quantized_2hop_bytes(9, 2, 2)


def test_error_bound_helper_matches_derivation():
    a = torch.tensor([0.0, 1.0, 3.0e38, 1e-40])
    for bits, lv in ((8, 127), (4, 7)):
        want = a.double() / (2 * lv) + a.double() * 2.0**-22 + (lv + 1) / 2 * ETA
        assert torch.equal(cc.error_bound(a, bits), want)
    x = torch.tensor([1.0, -3.0, 2.0, 0.5])
    assert cc.block_absmax(x, 2, 16).tolist() == [3.0, 3.0, 2.0, 2.0]
