"""Format version 2 of the 8-bit block quantization (``zerokern.quant.blockwise``) against
float64 references: the signed scale, the reciprocal (and the division it falls back to at
extreme scales), the error bound against float64, exact re-encoding of decoded blocks, and
that version 1 states decode unchanged. The kernels are compared with this oracle elsewhere
(tests/test_ops_adamw_compressed.py, Triton and CUDA tests)."""

from __future__ import annotations

import pytest
import torch

from zerokern.quant.blockwise import (
    RECIP_HI,
    RECIP_LO,
    block_scales,
    normalise,
    quantize_blockwise_v2,
)
from zerokern.quant.maps import (
    BLOCK,
    create_dynamic_map,
    decision_thresholds,
    dequantize_blockwise,
    quantize_blockwise,
)

SIGNED = create_dynamic_map(True)
UNSIGNED = create_dynamic_map(False)
MAPS = pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _per_element(values: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    return values.repeat_interleave(block)[:numel]


def _assert_within_bound(x: torch.Tensor, code: torch.Tensor, block: int = BLOCK) -> None:
    """|y - x| <= |s| * (h + 2**-21) + 2**-149 in float64 (blockwise module docstring), and
    the scale is the signed extreme of its block."""
    codes, scale = quantize_blockwise_v2(x, code, block)
    y = dequantize_blockwise(codes, scale, code, block).reshape(-1).double()
    v = x.reshape(-1).double()
    numel = v.numel()
    s = _per_element(scale.double(), numel, block)
    # The scale: +-max|x|, negative only when no element reaches +max|x|.
    for b in range(scale.numel()):
        part = v[b * block:(b + 1) * block]
        a = part.abs().max()
        want = a if (a == 0 or bool((part == a).any())) else -a
        assert scale[b].item() == want.item(), f"block {b}"
    c = code.double()
    r = torch.where(s != 0, v / torch.where(s != 0, s, 1.0), 0.0)
    hi = torch.searchsorted(c, r).clamp(max=255)  # first code >= r
    lo = (hi - 1).clamp(min=0)
    half = torch.where(hi == 0, c[0] - r, (c[hi] - c[lo]) / 2)  # below the map: distance to it
    bound = s.abs() * (half + 2.0**-21) + 2.0**-149
    err = (y - v).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"element {worst}: x={v[worst].item()!r} y={y[worst].item()!r} s={s[worst].item()!r}")


def _assert_reencodes(x: torch.Tensor, code: torch.Tensor, block: int = BLOCK) -> None:
    """Decode, then encode again: the same codes and the same scales (blocks whose decoded
    values are zero or normal fp32)."""
    codes, scale = quantize_blockwise_v2(x, code, block)
    y = dequantize_blockwise(codes, scale, code, block)
    codes2, scale2 = quantize_blockwise_v2(y, code, block)
    assert torch.equal(_bits(scale2), _bits(scale))
    bad = (codes2 != codes).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} codes moved, first at {bad[:5].tolist()}"


def _random_blocks(gen: torch.Generator, numel: int, lo: float = -25.0) -> torch.Tensor:
    # Magnitudes spread over many decades per block, like Adam moments.
    mag = torch.exp(torch.empty(numel).uniform_(lo, 5.0, generator=gen))
    sign = torch.where(torch.rand(numel, generator=gen) < 0.5, -1.0, 1.0)
    return (mag * sign).float()


@MAPS
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000, 4096])
def test_bound_random(code: torch.Tensor, numel: int) -> None:
    x = _random_blocks(torch.Generator().manual_seed(numel), numel)
    if code is UNSIGNED:
        x = x.abs()
    _assert_within_bound(x, code)


@MAPS
@pytest.mark.parametrize("exponent", [-140, -130, -100, -60, -3, 0, 20, 60, 100, 125, 126, 127])
def test_bound_at_every_scale(code: torch.Tensor, exponent: int) -> None:
    # Scales below 2**-126 and from 2**126 up divide; the rest use the reciprocal.
    gen = torch.Generator().manual_seed(exponent + 200)
    x = (_random_blocks(gen, 4 * BLOCK, lo=-12.0).double() * 2.0**exponent / 150).float()
    x[::BLOCK] = 1.7 * 2.0**exponent * torch.tensor([1.0, -1.0, 1.0, -1.0])
    if code is UNSIGNED:
        x = x.abs()
    _assert_within_bound(x, code)


@MAPS
@pytest.mark.parametrize("seed", range(6))
def test_decoding_then_encoding_gives_the_codes_back(code: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = _random_blocks(gen, 37 * BLOCK + 11, lo=-18.0)
    if code is UNSIGNED:
        x = x.abs()
    else:  # blocks whose largest element is negative, and ties between +max and -max
        x.view(-1)[: 37 * BLOCK].view(37, BLOCK)[::3, 7] = -1e3
        x.view(-1)[: 37 * BLOCK].view(37, BLOCK)[1::6, 9] = 1e3
    for scale_exp in (0, -100, 100):  # reciprocal path well inside; near both ends
        xs = (x.double() * 2.0**scale_exp).float()
        _assert_reencodes(xs, code)
    # Blocks of one map value each, every code, both signs of the scale.
    values = code.repeat(4).reshape(4, 256)
    values[1] *= -1.0
    values[2] *= 3.0
    values[3] *= -0.37
    _assert_reencodes(values.reshape(-1).contiguous(), code)


def test_version_1_failed_to_reencode_negative_maxima() -> None:
    # Why version 2 signs its scale: the signed map has no -1, so version 1 decoded a block
    # whose largest element is negative to a smaller absmax and moved codes on re-encoding.
    x = torch.tensor([-1.0, 0.5, 0.9, -0.2] * 64)
    codes, absmax = quantize_blockwise(x, SIGNED)
    y = dequantize_blockwise(codes, absmax, SIGNED)
    codes1, absmax1 = quantize_blockwise(y, SIGNED)
    assert not (torch.equal(codes1, codes) and torch.equal(absmax1, absmax))
    _assert_reencodes(x, SIGNED)


def test_version_1_state_decodes_unchanged() -> None:
    # Same maps and the same decoding: a version 1 state is a valid version 2 state.
    x = _random_blocks(torch.Generator().manual_seed(3), 3 * BLOCK)
    codes, absmax = quantize_blockwise(x, SIGNED)
    y1 = dequantize_blockwise(codes, absmax, SIGNED)
    assert bool((absmax >= 0).all())
    # A positive scale of the same value encodes positive maxima the same way up to the
    # reciprocal's rounding; decoding does not depend on the version at all.
    assert torch.equal(_bits(y1), _bits(dequantize_blockwise(codes, absmax.clone(), SIGNED)))


def test_scale_sign_rule_and_special_blocks() -> None:
    rows = torch.tensor([
        [1.0, -1.0, 0.5, 0.0],   # tie: +max wins
        [-2.0, 1.0, 0.0, 1.5],   # negative extreme
        [0.0, -0.0, 0.0, 0.0],   # all zero: +0
        [-0.0, -0.0, -0.0, -0.0],  # all -0: +0
        [float("inf"), -1.0, 0.0, 2.0],
        [float("-inf"), 1.0, 0.0, 2.0],
        [float("nan"), 1.0, -5.0, 0.0],
    ])
    s = block_scales(rows)
    assert s[:6].tolist() == [1.0, -2.0, 0.0, 0.0, float("inf"), float("-inf")]
    assert _bits(s[2:4]).tolist() == [0, 0]  # +0, not -0
    assert torch.isnan(s[6])


def test_normalise_is_a_reciprocal_product_inside_and_a_division_outside() -> None:
    x = torch.tensor([0.3, -0.7, 1.0, 0.123456789, 3e-39, -5e-39], dtype=torch.float32)
    for d in (3.0, -7.1, 2.0**-126, 2.0**-127, 2.0**126 * 0.999, 2.0**126, float("inf")):
        dv = torch.tensor(d, dtype=torch.float32)
        got = normalise(x, dv)
        if RECIP_LO <= abs(float(dv)) < RECIP_HI:
            r = (1.0 / dv.double()).float()
            want = (x.double() * r.double()).float()
        else:
            want = (x.double() / dv.double()).float()
        assert torch.equal(_bits(got), _bits(want)), d
    # A zero scale divides by 1 (an all-zero block decodes to zeros).
    assert torch.equal(normalise(torch.zeros(3), torch.tensor(0.0)), torch.zeros(3))


@MAPS
def test_codes_follow_the_thresholds(code: torch.Tensor) -> None:
    # The code rule is version 1's: #{t < n} (n >= 0), #{t <= n} (n < 0), on n = x * r.
    t = decision_thresholds(code)
    n = torch.cat([t, torch.nextafter(t, torch.full_like(t, 2.0)),
                   torch.nextafter(t, torch.full_like(t, -2.0))])
    n = n[n.abs() <= 1.0]
    x = torch.cat([n, torch.ones(1)])  # the 1.0 makes the scale 1 and r = 1
    codes, scale = quantize_blockwise_v2(x, code, block=x.numel())
    assert scale.tolist() == [1.0]
    want = torch.where(n < 0, torch.searchsorted(t, n, right=True),
                       torch.searchsorted(t, n, right=False))
    assert torch.equal(codes[:-1].long(), want)


def test_nan_and_inf_blocks() -> None:
    x = torch.ones(3 * BLOCK)
    x[5] = float("nan")
    x[BLOCK + 3] = float("inf")
    codes, scale = quantize_blockwise_v2(x, SIGNED)
    y = dequantize_blockwise(codes, scale, SIGNED)
    assert bool(torch.isnan(y[:BLOCK]).all())
    assert scale[1].item() == float("inf")
    assert torch.equal(y[2 * BLOCK:], torch.ones(BLOCK))


def test_argument_checks() -> None:
    with pytest.raises(TypeError, match="x must be fp32"):
        quantize_blockwise_v2(torch.ones(4).double(), SIGNED)
    with pytest.raises(ValueError, match="block"):
        quantize_blockwise_v2(torch.ones(4), SIGNED, block=0)
    with pytest.raises(ValueError, match="code"):
        quantize_blockwise_v2(torch.ones(4), SIGNED[:255])


def test_property_random_blocks() -> None:
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True, database=None)
    @hypothesis.given(
        values=st.lists(finite32, min_size=1, max_size=600),
        block=st.sampled_from([1, 3, 64, 256]),
        signed=st.booleans(),
    )
    def check(values: list[float], block: int, signed: bool) -> None:
        x = torch.tensor(values, dtype=torch.float32)
        code = SIGNED if signed else UNSIGNED
        if not signed:
            x = x.abs()
        _assert_within_bound(x, code, block)
        codes, scale = quantize_blockwise_v2(x, code, block)
        y = dequantize_blockwise(codes, scale, code, block)
        if bool(((y == 0) | (y.abs() >= 2.0**-126)).all()):
            _assert_reencodes(x, code, block)

    check()
