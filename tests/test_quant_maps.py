"""The 8-bit dynamic maps and the block-wise quantize/dequantize oracle (zerokern.quant.maps).

References are independent of the code under test: the exact float64 formula of each map
value, the anchors' own recipe (``torch.linspace`` in fp32), bitsandbytes' and torchao's maps
when installed, a pinned hash of the map bytes, and float64 error bounds and nearest-code
searches for quantization.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

import zerokern
from zerokern.quant.maps import (
    BLOCK,
    MAP_IDS,
    SIGNED_MAP_ID,
    UNSIGNED_MAP_ID,
    code_map,
    create_dynamic_map,
    decision_thresholds,
    decodes_alike,
    dequantize_blockwise,
    quantize_blockwise,
)

SIGNED = create_dynamic_map(True)
UNSIGNED = create_dynamic_map(False)

# sha256 of the 256 little-endian fp32 values: a map id must always name the same bytes.
_SIGNED_HASH = "e732639a65f497b4ad684bb166a4467708255edd5207757de8b8f0c7e1fda89c"
_UNSIGNED_HASH = "305f002cc11278fb769d13b25b9fd0c7c83c8402c40a878fe086f4039fde6398"
# Format version 2 (zerokern.quant.blockwise) encodes differently; the maps are version 1's.
PINNED = {
    SIGNED_MAP_ID: _SIGNED_HASH, "dynamic-signed-v1": _SIGNED_HASH,
    UNSIGNED_MAP_ID: _UNSIGNED_HASH, "dynamic-unsigned-v1": _UNSIGNED_HASH,
    # Format version 3's computed maps (zerokern.quant.fmt_v3), as checkpoints name them.
    "computed-signed-v3": "782a08dba46804731357c09bdd89ece0381a70f825432dfcbe0cb90e00e76f93",
    "computed-unsigned-v3": "fac492af806ee84864d5c54bb45b2830f720200435e58ad836b0c0b045b89387",
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# ---------------------------------------------------------------------------------------------
# The maps


@pytest.mark.parametrize("signed", [True, False])
def test_map_sorted_sizes_ranges(signed: bool) -> None:
    m = create_dynamic_map(signed)
    assert m.dtype == torch.float32 and m.shape == (256,)
    assert bool((m[1:] > m[:-1]).all())
    assert m[-1].item() == 1.0
    zero = 127 if signed else 0
    assert m[zero].item() == 0.0 and not math.copysign(1.0, m[zero].item()) < 0
    if signed:
        assert m[0].item() == -m[-2].item()  # no -1: that bit pattern carries +1
        assert abs(m[0].item() + 0.99296875) < 2.0**-24
        assert int((m < 0).sum()) == 127 and int((m > 0).sum()) == 128
    else:
        assert int((m > 0).sum()) == 255
    assert float(m.abs().max()) == 1.0


def test_signed_map_mirrors_except_one() -> None:
    neg = sorted(-v for v in SIGNED.tolist() if v < 0)
    pos = [v for v in SIGNED.tolist() if v > 0]
    assert pos[-1] == 1.0
    assert neg == pos[:-1]


@pytest.mark.parametrize("signed", [True, False])
def test_map_values_follow_the_formula(signed: bool) -> None:
    # Independent float64 reference: 10**-e times the centres of 2**(6-e) (signed) or
    # 2**(7-e) (unsigned) equal bins of [0.1, 1]; fp32 rounding keeps each within a few ulps.
    want = [0.0, 1.0]
    for e in range(7):
        bins = 2 ** (6 - e + (0 if signed else 1))
        for j in range(bins):
            v = 10.0**-e * (0.1 + 0.9 * (j + 0.5) / bins)
            want += [v, -v] if signed else [v]
    want.sort()
    got = create_dynamic_map(signed).double()
    want_t = torch.tensor(want, dtype=torch.float64)
    assert got.shape == want_t.shape
    assert bool(((got - want_t).abs() <= 4 * 2.0**-24 * want_t.abs()).all())
    # Per decade: 2**(6-e) (signed, each sign) or 2**(7-e) positive codes in [0.1, 1) * 10**-e.
    pos = got[got > 0]
    for e in range(7):
        lo, hi = 0.1 * 10.0**-e, 10.0**-e
        count = int(((pos >= lo * (1 - 1e-6)) & (pos < hi * (1 - 1e-6))).sum())
        assert count == 2 ** (6 - e + (0 if signed else 1)), e


@pytest.mark.parametrize("signed", [True, False])
def test_map_equals_the_anchor_recipe(signed: bool) -> None:
    # The anchors build their maps with torch.linspace in fp32: bin edges of [0.1, 1], the
    # fp32 mean of neighbouring edges, scaled by a power of ten. Ours is built without torch.
    values = [0.0, 1.0]
    for e in range(7):
        bins = 2 ** (6 - e + (0 if signed else 1))
        edges = torch.linspace(0.1, 1.0, bins + 1, dtype=torch.float32)
        mags = (10.0**-e) * ((edges[1:] + edges[:-1]) / 2.0)
        values += mags.tolist()
        if signed:
            values += (-mags).tolist()
    recipe = torch.tensor(sorted(values), dtype=torch.float32)
    assert torch.equal(_bits(recipe), _bits(create_dynamic_map(signed))), (
        "differs from torch.linspace's recipe on this platform (maps are pinned by hash)"
    )


@pytest.mark.parametrize("map_id", MAP_IDS)
def test_map_bytes_are_pinned(map_id: str) -> None:
    data = code_map(map_id).numpy().astype("<f4").tobytes()
    assert hashlib.sha256(data).hexdigest() == PINNED[map_id]


def test_map_ids() -> None:
    # These strings go into checkpoints: changing them breaks every saved int8 state.
    assert SIGNED_MAP_ID == "dynamic-signed-v2"
    assert UNSIGNED_MAP_ID == "dynamic-unsigned-v2"
    # Version 1 checkpoints name these and still load; version 3 names its computed maps.
    assert set(MAP_IDS) == {SIGNED_MAP_ID, UNSIGNED_MAP_ID, "dynamic-signed-v1",
                            "dynamic-unsigned-v1", "computed-signed-v3", "computed-unsigned-v3"}
    assert torch.equal(_bits(code_map(SIGNED_MAP_ID)), _bits(SIGNED))
    assert torch.equal(_bits(code_map(UNSIGNED_MAP_ID)), _bits(UNSIGNED))
    assert torch.equal(_bits(code_map("dynamic-signed-v1")), _bits(SIGNED))
    assert torch.equal(_bits(code_map("dynamic-unsigned-v1")), _bits(UNSIGNED))
    assert decodes_alike("dynamic-signed-v1", SIGNED_MAP_ID)
    assert decodes_alike("dynamic-unsigned-v1", UNSIGNED_MAP_ID)
    assert not decodes_alike(SIGNED_MAP_ID, UNSIGNED_MAP_ID)
    assert not decodes_alike("dynamic-signed-v3", SIGNED_MAP_ID)
    with pytest.raises(ValueError, match="dynamic-signed-v2"):
        code_map("dynamic-signed-v3")
    assert code_map(SIGNED_MAP_ID) is not code_map(SIGNED_MAP_ID)  # callers may mutate theirs


def test_version_3_ids_name_the_computed_maps() -> None:
    """Version 3's ids decode on fmt_v3's maps, never alike version 1/2's (their codes are
    re-encoded, not copied, across versions); each id knows its version and its sign."""
    from zerokern.quant import fmt_v3
    from zerokern.quant.maps import map_version, step_version, versioned_map_id

    v3 = {True: fmt_v3.SIGNED_MAP_ID_V3, False: fmt_v3.UNSIGNED_MAP_ID_V3}
    for signed, map_id in v3.items():
        assert map_id in MAP_IDS and map_version(map_id) == step_version(map_id) == 3
        assert torch.equal(_bits(code_map(map_id)), _bits(fmt_v3.code_map_v3(signed)))
        assert code_map(map_id) is not fmt_v3.code_map_v3(signed)  # not the shared cache
        v2 = SIGNED_MAP_ID if signed else UNSIGNED_MAP_ID
        assert versioned_map_id(v2, 3) == map_id and versioned_map_id(map_id, 2) == v2
        assert versioned_map_id(f"dynamic-{'un' * (not signed)}signed-v1", 3) == map_id
        for old in (v2, f"dynamic-{'un' * (not signed)}signed-v1"):
            assert not decodes_alike(old, map_id) and not decodes_alike(map_id, old)
        assert decodes_alike(map_id, map_id)
    assert not decodes_alike(v3[True], v3[False])
    assert (map_version("dynamic-signed-v1"), step_version("dynamic-signed-v1")) == (1, 2)
    for bad in (1, 4, True):
        with pytest.raises(ValueError, match="version must be 2 or 3"):
            versioned_map_id(SIGNED_MAP_ID, bad)
    with pytest.raises(ValueError, match="unknown quantization map id 'computed-signed-v4'"):
        map_version("computed-signed-v4")


def test_package_stays_internal() -> None:
    assert "quant" not in zerokern.__all__
    assert not {"quantize_blockwise", "dequantize_blockwise", "code_map"} & set(zerokern.__all__)


@pytest.mark.parametrize("signed", [True, False])
def test_bitsandbytes_maps_bit_for_bit(signed: bool) -> None:
    functional = pytest.importorskip("bitsandbytes.functional")
    theirs = functional.create_dynamic_map(signed=signed).to("cpu", torch.float32)
    assert torch.equal(_bits(theirs), _bits(create_dynamic_map(signed)))


@pytest.mark.parametrize("signed", [True, False])
def test_torchao_maps_bit_for_bit(signed: bool) -> None:
    pytest.importorskip("torchao")
    import importlib

    for name in ("torchao.optim.quant_utils", "torchao.prototype.low_bit_optim.quant_utils"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "create_dynamic_map"):
            break
    else:
        pytest.skip("this torchao has no create_dynamic_map")
    theirs = torch.tensor(module.create_dynamic_map(signed), dtype=torch.float32)
    assert torch.equal(_bits(theirs), _bits(create_dynamic_map(signed)))


@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_decision_thresholds(code: torch.Tensor) -> None:
    t = decision_thresholds(code)
    assert t.dtype == torch.float32 and t.shape == (255,)
    c = code.double()
    exact = (c[:-1] + c[1:]) / 2
    assert bool((t.double() >= c[:-1]).all()) and bool((t.double() <= c[1:]).all())
    # One rounding of the exact midpoint: at most half an ulp away.
    mag = t.abs()
    ulp = torch.nextafter(mag, torch.full_like(mag, math.inf)).double() - mag.double()
    assert bool(((t.double() - exact).abs() <= ulp / 2).all())


# ---------------------------------------------------------------------------------------------
# Quantization: float64 references


def _absmax_per_element(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1).double()
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), block):
        out[start:start + block] = flat[start:start + block].abs().max()
    return out


def _assert_within_bound(x: torch.Tensor, code: torch.Tensor, block: int = BLOCK) -> None:
    """|dequantize(quantize(x)) - x| <= absmax * (h + 2**-22) + 2**-149, in float64."""
    codes, absmax = quantize_blockwise(x, code, block)
    y = dequantize_blockwise(codes, absmax, code, block).reshape(-1).double()
    v = x.reshape(-1).double()
    a = _absmax_per_element(x, block)
    assert torch.equal(absmax.double(), a[::block])
    c = code.double()
    r = torch.where(a > 0, v / torch.where(a > 0, a, 1.0), 0.0)
    hi = torch.searchsorted(c, r).clamp(max=255)  # first code >= r
    lo = (hi - 1).clamp(min=0)
    half = torch.where(hi == 0, c[0] - r, (c[hi] - c[lo]) / 2)  # below the map: distance to it
    bound = a * (half + 2.0**-22) + 2.0**-149
    err = (y - v).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"element {worst}: x={v[worst].item()!r} y={y[worst].item()!r} absmax={a[worst].item()!r}"
    )


def _assert_nearest(x: torch.Tensor, code: torch.Tensor, block: int = BLOCK) -> None:
    """The chosen code is the nearest to x/absmax (fp32) up to the threshold rounding."""
    codes, absmax = quantize_blockwise(x, code, block)
    a = _absmax_per_element(x, block).float()
    n = (x.reshape(-1) / torch.where(a == 0, 1.0, a)).double()
    dist = (n[:, None] - code.double()[None, :]).abs()
    best, second = dist.topk(2, dim=1, largest=False).values.unbind(1)
    chosen = dist.gather(1, codes.reshape(-1, 1).long()).squeeze(1)
    slack = 2.0**-22 * n.abs() + 2.0**-149
    assert bool((chosen <= best + slack).all())
    clear = second - best > 2 * slack
    assert torch.equal(codes.reshape(-1)[clear].long(), dist.argmin(1)[clear])


def _random_blocks(gen: torch.Generator, numel: int) -> torch.Tensor:
    # Magnitudes spread over many decades per block, like Adam moments.
    mag = torch.exp(torch.empty(numel).uniform_(-25.0, 5.0, generator=gen))
    sign = torch.where(torch.rand(numel, generator=gen) < 0.5, -1.0, 1.0)
    return (mag * sign).float()


@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000, 4096])
def test_roundtrip_bound_random(code: torch.Tensor, numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    x = _random_blocks(gen, numel)
    if code is UNSIGNED:
        x = x.abs()
    _assert_within_bound(x, code)
    _assert_nearest(x, code)


def test_shapes_and_partial_last_block() -> None:
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    codes, absmax = quantize_blockwise(x, SIGNED)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 100)
    assert absmax.dtype == torch.float32 and absmax.shape == (2,)  # 256 + 44
    assert absmax[1].item() == x.reshape(-1)[256:].abs().max().item()
    y = dequantize_blockwise(codes, absmax, SIGNED)
    assert y.dtype == torch.float32 and y.shape == (3, 100)
    # The partial block is quantized as if it stood alone.
    tail_codes, tail_absmax = quantize_blockwise(x.reshape(-1)[256:].clone(), SIGNED)
    assert torch.equal(tail_codes, codes.reshape(-1)[256:]) and torch.equal(tail_absmax, absmax[1:])
    empty_codes, empty_absmax = quantize_blockwise(torch.empty(0), SIGNED)
    assert empty_codes.numel() == 0 and empty_absmax.numel() == 0
    assert dequantize_blockwise(empty_codes, empty_absmax, SIGNED).numel() == 0


def test_blocks_are_independent() -> None:
    # A shard that starts on a block boundary quantizes to the same bytes as the whole
    # parameter's slice: the format does not depend on how a parameter is split.
    x = _random_blocks(torch.Generator().manual_seed(1), 5 * 256 + 17)
    codes, absmax = quantize_blockwise(x, SIGNED)
    for start, stop in [(0, 512), (512, 1024), (1024, x.numel())]:
        part_codes, part_absmax = quantize_blockwise(x[start:stop].clone(), SIGNED)
        assert torch.equal(part_codes, codes[start:stop])
        assert torch.equal(_bits(part_absmax), _bits(absmax[start // 256:-(-stop // 256)]))


@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_zeros_and_negative_zero(code: torch.Tensor) -> None:
    x = torch.zeros(600)
    x[::3] = -0.0
    codes, absmax = quantize_blockwise(x, code)
    assert bool((absmax == 0).all())
    zero = int((code == 0).nonzero())
    assert bool((codes == zero).all())
    y = dequantize_blockwise(codes, absmax, code)
    assert bool((_bits(y) == 0).all())  # +0.0 everywhere, -0.0 included
    # -0.0 next to nonzero values also takes the zero code.
    x = torch.tensor([-0.0, 0.5, 0.0, 1.0])
    codes, absmax = quantize_blockwise(x, code)
    assert codes[0].item() == zero and codes[2].item() == zero
    assert _bits(dequantize_blockwise(codes, absmax, code))[0].item() == 0


@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_subnormals(code: torch.Tensor) -> None:
    tiny = torch.finfo(torch.float32).tiny  # smallest normal
    gen = torch.Generator().manual_seed(2)
    x = (torch.rand(512, generator=gen) * tiny).float()  # nearly all subnormal
    x[0] = 1e-45  # the smallest subnormal
    x[300] = 0.0
    if code is SIGNED:
        x[::2] = -x[::2]
    assert bool((x.abs() < tiny).all())
    codes, absmax = quantize_blockwise(x, code)
    assert bool((absmax > 0).all()) and bool((absmax < tiny).all())
    _assert_within_bound(x, code)
    _assert_nearest(x, code)
    # A subnormal next to a normal value: it lands on the zero code or a tiny one, within bound.
    mixed = torch.tensor([1e-40, 1.0, -3e-39, 0.25])
    _assert_within_bound(mixed.abs() if code is UNSIGNED else mixed, code)


@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_huge_values(code: torch.Tensor) -> None:
    big = torch.finfo(torch.float32).max
    x = torch.tensor([1e38, -3e37, 5e30, 1.0, big, -big, 1e-30, 0.0] * 40, dtype=torch.float32)
    if code is UNSIGNED:
        x = x.abs()
    codes, absmax = quantize_blockwise(x, code)
    y = dequantize_blockwise(codes, absmax, code)
    assert bool(torch.isfinite(y).all())
    _assert_within_bound(x, code)
    _assert_nearest(x, code)
    assert y[4].item() == big  # the positive absmax element is exact


@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_one_outlier(code: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(256 * 3, generator=gen) * 1e-3).float()
    if code is UNSIGNED:
        x = x.abs()
    x[300] = 1e4  # only block 1 sees it
    codes, absmax = quantize_blockwise(x, code)
    assert absmax[1].item() == 1e4
    for b in (0, 2):
        alone_codes, alone_absmax = quantize_blockwise(x[b * 256:(b + 1) * 256].clone(), code)
        assert torch.equal(alone_codes, codes[b * 256:(b + 1) * 256])
    y = dequantize_blockwise(codes, absmax, code)
    assert y[300].item() == 1e4
    # Everything else in the outlier's block is under 1e-6 of it: zero code or the smallest.
    _assert_within_bound(x, code)
    _assert_nearest(x, code)


@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
@pytest.mark.parametrize("exponent", [-100, -20, 0, 7, 100])
def test_exact_code_values_round_trip(code: torch.Tensor, exponent: int) -> None:
    # A block holding every map value times a power of two: absmax is that power (the code 1.0),
    # each x / absmax is exactly a map value, and decoding multiplies back exactly.
    scale = 2.0**exponent
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(exponent + 200))
    x = torch.cat([code[perm] * scale, code.flip(0) * scale])
    codes, absmax = quantize_blockwise(x, code)
    assert bool((absmax == scale).all())
    assert torch.equal(codes[:256].long(), perm)
    assert torch.equal(codes[256:].long(), torch.arange(255, -1, -1))
    y = dequantize_blockwise(codes, absmax, code)
    assert torch.equal(_bits(y), _bits(x))


def test_signed_negative_absmax_takes_lowest_code() -> None:
    # -1 is below the signed map; it goes to the lowest code, about half the top step away.
    x = torch.tensor([-2.0, 1.0, 0.5])
    codes, absmax = quantize_blockwise(x, SIGNED)
    assert absmax.item() == 2.0 and codes[0].item() == 0
    y = dequantize_blockwise(codes, absmax, SIGNED)
    assert y[0].item() == SIGNED[0].item() * 2.0
    half_top_step = (SIGNED[-2].double() - SIGNED[-3].double()).item() / 2
    assert abs(abs(y[0].item() - x[0].item()) / 2.0 - half_top_step) < 2.0**-22
    _assert_within_bound(x, SIGNED)


@pytest.mark.parametrize("code", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_ties_go_toward_zero(code: torch.Tensor) -> None:
    t = decision_thresholds(code)
    # absmax 1 (the code 1.0 is in the block), so n == x exactly and x sits on a threshold.
    x = torch.cat([t, torch.ones(1)])
    codes, _ = quantize_blockwise(x, code, block=x.numel())
    k = torch.arange(255)
    values = code[codes[:255].long()]
    smaller = torch.where(code[k].abs() <= code[k + 1].abs(), code[k], code[k + 1])
    assert torch.equal(values, smaller)


def test_signed_rule_is_sign_symmetric() -> None:
    # Away from the unmirrored top code (+1.0), quantize(-x) decodes to -quantize(x).
    x = _random_blocks(torch.Generator().manual_seed(4), 2048).reshape(-1, 256)
    absmax = x.abs().amax(1, keepdim=True)
    x = torch.maximum(torch.minimum(x, absmax * 0.99), -absmax * 0.99)
    x[:, 0] = absmax[:, 0]  # x and -x share each block's absmax
    pos, _ = quantize_blockwise(x, SIGNED)
    neg, _ = quantize_blockwise(-x, SIGNED)
    assert torch.equal(SIGNED[pos[:, 1:].long()], -SIGNED[neg[:, 1:].long()])


def test_unsigned_map_clamps_negatives_to_zero() -> None:
    codes, absmax = quantize_blockwise(torch.tensor([-1.0, -1e-3, 0.5, 1.0]), UNSIGNED)
    assert codes[:2].tolist() == [0, 0] and UNSIGNED[0].item() == 0.0


def test_nan_and_inf_blocks() -> None:
    gen = torch.Generator().manual_seed(5)
    x = _random_blocks(gen, 4 * 256)
    x[10] = float("nan")  # block 0
    x[256 + 7] = float("inf")  # block 1
    x[256 + 8] = -float("inf")
    codes, absmax = quantize_blockwise(x, SIGNED)
    assert math.isnan(absmax[0].item()) and absmax[1].item() == math.inf
    assert codes[10].item() == 0
    y = dequantize_blockwise(codes, absmax, SIGNED)
    assert bool(torch.isnan(y[:256]).all())
    # inf block: finite elements take the zero code (0 * inf = NaN); the infs take code 0.
    assert codes[263].item() == 0 and codes[264].item() == 0
    assert y[263].item() == -math.inf and y[264].item() == -math.inf
    finite = torch.ones(256, dtype=torch.bool)
    finite[7:9] = False
    assert bool((codes[256:512][finite] == 127).all())
    assert bool(torch.isnan(y[256:512][finite]).all())
    # Untouched blocks decode as they would alone.
    rest_codes, rest_absmax = quantize_blockwise(x[512:].clone(), SIGNED)
    assert torch.equal(rest_codes, codes[512:]) and torch.equal(rest_absmax, absmax[2:])
    # Unsigned map: an inf block decodes to NaN throughout.
    ucodes, uabsmax = quantize_blockwise(x[256:512].abs(), UNSIGNED)
    assert bool(torch.isnan(dequantize_blockwise(ucodes, uabsmax, UNSIGNED)).all())


def test_determinism() -> None:
    x = _random_blocks(torch.Generator().manual_seed(6), 3000)
    first = quantize_blockwise(x, SIGNED)
    second = quantize_blockwise(x.clone(), SIGNED)
    assert torch.equal(first[0], second[0]) and torch.equal(_bits(first[1]), _bits(second[1]))
    y1 = dequantize_blockwise(*first, SIGNED)
    y2 = dequantize_blockwise(*second, SIGNED)
    assert torch.equal(_bits(y1), _bits(y2))
    # The shape of the input does not matter, only its flattened order.
    shaped = quantize_blockwise(x.reshape(30, 100), SIGNED)
    assert torch.equal(shaped[0].reshape(-1), first[0]) and torch.equal(shaped[1], first[1])


def test_argument_checks() -> None:
    x = torch.ones(10)
    with pytest.raises(TypeError):
        quantize_blockwise(x.double(), SIGNED)
    with pytest.raises(ValueError):
        quantize_blockwise(x, SIGNED[:255])
    with pytest.raises(ValueError):
        quantize_blockwise(x, SIGNED.flip(0))
    with pytest.raises(ValueError):
        quantize_blockwise(x, SIGNED, block=0)
    codes, absmax = quantize_blockwise(x, SIGNED, block=4)
    with pytest.raises(ValueError, match="absmax"):
        dequantize_blockwise(codes, absmax, SIGNED)
    with pytest.raises(TypeError):
        dequantize_blockwise(codes.long(), absmax, SIGNED, block=4)
    with pytest.raises(TypeError):
        dequantize_blockwise(codes, absmax.double(), SIGNED, block=4)


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
        _assert_nearest(x, code, block)
        again = quantize_blockwise(x.clone(), code, block)
        codes, absmax = quantize_blockwise(x, code, block)
        assert torch.equal(codes, again[0]) and torch.equal(_bits(absmax), _bits(again[1]))

    check()
