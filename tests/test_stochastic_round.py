"""Stochastic rounding fp32 -> bf16 (zerokern/quant/rounding.py), against float64 and
torch's own bf16 neighbours (round-to-nearest ``to(torch.bfloat16)`` and ``torch.nextafter``),
never against the bit trick it implements:

* representable values (every bf16 bit pattern) come back unchanged, whatever the bits;
* the result is always one of the two bf16 neighbours of x;
* over all 2**16 values of the random bits the mean result is x exactly (the rounding is
  unbiased given uniform bits), and with Philox bits (``sr_bits``, many steps) the mean is
  within a 6-sigma bound of x that truncation or round-to-nearest would break;
* NaN, inf, overflow above bf16's largest finite value, subnormals, signs, as documented;
* reproducible: the same (seed, step, index) gives the same result.
"""

from __future__ import annotations

import pytest
import torch

from zerokern.quant.philox import sr_bits
from zerokern.quant.rounding import BF16_MAX, BF16_NAN, stochastic_round_bf16

INF = float("inf")


def _f32(patterns) -> torch.Tensor:
    """fp32 tensor from unsigned 32-bit patterns."""
    p = torch.as_tensor(patterns, dtype=torch.int64)
    return (p - ((p >> 31) << 32)).to(torch.int32).view(torch.float32)


def _u16(y: torch.Tensor) -> torch.Tensor:
    """The bf16 bit patterns of y, as int64 in [0, 2**16)."""
    return y.view(torch.int16).to(torch.int64) & 0xFFFF


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each finite x (equal when x is one), as
    float64, from torch's round-to-nearest cast and nextafter; x within bf16's finite range."""
    n = x.to(torch.bfloat16)
    nd, xd = n.double(), x.double()
    up = torch.nextafter(n, torch.full_like(n, INF)).double()
    down = torch.nextafter(n, torch.full_like(n, -INF)).double()
    lo = torch.where(nd <= xd, nd, down)
    hi = torch.where(nd >= xd, nd, up)
    return lo, hi


def _random_finite(n: int, seed: int) -> torch.Tensor:
    """Finite fp32 values of every magnitude (random bit patterns, NaN/inf redrawn), within
    bf16's finite range, plus subnormals and values next to binade boundaries."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randint(0, 2**32, (n,), generator=gen)
    mag = p & 0x7FFFFFFF
    p = torch.where(mag >= 0x7F7F0000, p & 0x8FFFFFFF, p)  # redraw into the finite range
    special = torch.tensor([0x00000001, 0x0000FFFF, 0x00010001, 0x007FFFFF, 0x00800001,
                            0x3F7FFFFF, 0x3F7F8001, 0x3F800001, 0x7F7EFFFF, 0x7F7E0001])
    p = torch.cat([p, special, special | 0x80000000])
    return _f32(p)


def test_representable_values_unchanged():
    pats = torch.arange(2**16)
    x = _f32(pats << 16)
    nan = x.isnan()
    for bits in (0, 0xFFFF, 0xFFFFFFFF, sr_bits(0, 0, pats), sr_bits(9, 3, pats)):
        y = stochastic_round_bf16(x, bits)
        assert torch.equal(_u16(y)[~nan], pats[~nan])
        assert (_u16(y)[nan] == BF16_NAN).all()
        # the float64 values agree too (-0.0 and 0.0 told apart by the patterns above)
        assert torch.equal(y.double()[~nan], x.double()[~nan])


def test_result_is_a_neighbour():
    x = _random_finite(50_000, 0)
    lo, hi = _neighbours(x)
    for step in (0, 77):
        y = stochastic_round_bf16(x, sr_bits(5, step, torch.arange(x.numel()))).double()
        ok = (y == lo) | (y == hi)
        assert ok.all(), x[~ok][:5].tolist()
        assert (torch.signbit(y) == torch.signbit(x.double())).all()
    # both neighbours occur: the rounding is not a disguised truncation
    assert ((y == lo) & (lo != hi)).any() and ((y == hi) & (lo != hi)).any()


def test_mean_over_all_bits_is_exact():
    """With r running over all 2**16 values, x rounds up exactly low16 times, so the mean of
    the results is lo + (x - lo) = x. The sum is exact in float64 (8-bit significands,
    2**16 terms), so the test demands equality."""
    x = _random_finite(44, 1)  # 64 values, subnormals and binade edges included
    y = stochastic_round_bf16(x.view(-1, 1).expand(-1, 2**16), torch.arange(2**16)).double()
    mean = y.sum(1) / 2**16
    assert torch.equal(mean, x.double()), x[mean != x.double()].tolist()


def test_unbiased_with_philox_bits():
    """The mean of K roundings of a fixed x at K different steps (the optimizer's case: one
    element, consecutive steps) is within 6 sigma of x.

    The error e = y - x takes hi - x with probability p = (x - lo) / (hi - lo) and lo - x
    otherwise: zero mean, variance p (1 - p) (hi - lo)**2 <= (hi - lo)**2 / 4. The mean of K
    independent errors has sigma = sqrt(p (1 - p) / K) (hi - lo); a 6-sigma excursion has
    probability about 2e-9 per value (normal approximation of a binomial count, good here
    since K p (1 - p) >= 1400 for every inexact value), and the seeds are fixed, so the test
    is deterministic. K = 16384 puts the bound at 6 / (2 * 128) = 0.0234 (hi - lo) at most:
    a rounding biased by more than that, e.g. truncation (bias p) or round-to-nearest
    (bias min(p, 1 - p)), fails it for the values chosen here (0.1 <= p <= 0.9). Fractions
    p near 0 or 1 are covered exactly by test_mean_over_all_bits_is_exact."""
    k = 16384
    gen = torch.Generator().manual_seed(2)
    # values at chosen fractions p of their gap, over many binades, both signs, subnormals
    base = torch.tensor([1.0, -1.0, 3.0e-3, -7.5e4, 2.0e30, 1.2e-38, 5.0e-40, -3.0e38])
    base = base.repeat(8).to(torch.bfloat16).float()
    frac = torch.tensor([0.0, 0.1, 0.25, 0.3, 0.5, 0.6, 0.77, 0.9]).repeat_interleave(8)
    b16 = base.to(torch.bfloat16)
    away = torch.nextafter(b16, torch.where(base > 0, INF, -INF).to(torch.bfloat16))
    gap = (away.double() - base.double()).abs()  # the gap above |base|
    x = (base.double() + torch.sign(base.double()) * frac.double() * gap).float()
    # fp32 holds the fraction to 2**-16 of a gap even for the subnormal base
    assert (x.double() - base.double()).abs().div(gap).sub(frac.double()).abs().max() < 2e-5
    lo, hi = _neighbours(x)
    p = ((x.double() - lo) / (hi - lo)).nan_to_num(0.0)  # lo == hi: exact, p = 0
    sigma = (p * (1 - p) / k).sqrt() * (hi - lo)
    bound = 6 * sigma
    steps = torch.arange(k).view(-1, 1)
    idx = torch.randperm(2**20, generator=gen)[:64].view(1, -1)
    y = stochastic_round_bf16(x.expand(k, 64), sr_bits(2026, steps, idx)).double()
    err = (y.mean(0) - x.double()).abs()
    assert (err <= bound).all(), (err / (hi - lo).clamp_min(1e-300))[err > bound].tolist()
    # exactly representable values never move
    exact = lo == hi
    assert exact.any() and (y[:, exact] == x.double()[exact]).all()
    # the bound is tight enough to catch a biased rounding: truncation toward zero and
    # round-to-nearest miss it wherever 0 < p < 1 (by p or min(p, 1 - p) gaps)
    inexact = (p > 0.05) & (p < 0.95)
    trunc = torch.where(x.double() >= 0, lo, hi)  # the neighbour nearer zero
    assert ((trunc - x.double()).abs() > bound)[inexact].all()
    rne = x.to(torch.bfloat16).double()
    assert ((rne - x.double()).abs() > bound)[inexact].all()


def test_special_values():
    r = torch.tensor([0, 1, 0x7FFF, 0x8000, 0xFFFF, 0xFFFFFFFF])

    def rnd(pattern):
        return _u16(stochastic_round_bf16(_f32([pattern]).expand(r.numel()), r))

    # NaN of any sign or payload, including payloads only in the low 16 bits (truncation
    # would make those inf) and all-ones (the addition would carry out): canonical NaN
    for nan in (0x7FC00000, 0x7F800001, 0x7F80FFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFC00000):
        assert (rnd(nan) == BF16_NAN).all(), hex(nan)
    assert (rnd(0x7F800000) == 0x7F80).all()  # +inf
    assert (rnd(0xFF800000) == 0xFF80).all()  # -inf
    # finite values above bf16's largest finite one saturate at it, never become inf
    for big in (0x7F7F0001, 0x7F7F8000, 0x7F7FFFFF):
        assert (rnd(big) == BF16_MAX).all(), hex(big)
        assert (rnd(big | 0x80000000) == BF16_MAX | 0x8000).all(), hex(big)
    # ... while below it the carry into the top finite value still happens
    assert rnd(0x7F7EFFFF).tolist() == [0x7F7E] + [0x7F7F] * 5
    assert rnd(0xFF7EFFFF).tolist() == [0xFF7E] + [0xFF7F] * 5
    # zeros keep their sign
    assert (rnd(0x00000000) == 0x0000).all() and (rnd(0x80000000) == 0x8000).all()
    # subnormals: no flush to zero; the largest one carries into the smallest normal
    assert rnd(0x00000001).tolist() == [0, 0, 0, 0, 1, 1]  # up only when r = 0xFFFF
    assert rnd(0x007FFFFF).tolist() == [0x007F] + [0x0080] * 5
    assert rnd(0x807FFFFF).tolist() == [0x807F] + [0x8080] * 5
    # halfway (low 16 bits 0x8000): up exactly when r's low 16 bits are >= 0x8000
    assert rnd(0x3F808000).tolist() == [0x3F80, 0x3F80, 0x3F80, 0x3F81, 0x3F81, 0x3F81]
    # only the low 16 bits of the random word count
    x = _random_finite(1000, 3)
    bits = sr_bits(1, 1, torch.arange(x.numel()))
    assert torch.equal(stochastic_round_bf16(x, bits), stochastic_round_bf16(x, bits & 0xFFFF))
    assert torch.equal(stochastic_round_bf16(x, bits), stochastic_round_bf16(x, bits | 2**40))


def test_overflow_neighbourhood_matches_float64():
    """Between bf16's two largest finite values the rounding is still a neighbour of x,
    and nothing finite becomes inf anywhere."""
    x = _f32(torch.arange(0x7F7E0000, 0x7F800000, 97))
    y = stochastic_round_bf16(x, sr_bits(4, 4, torch.arange(x.numel())))
    assert y.isfinite().all()
    below = x.double() <= torch.tensor(BF16_MAX << 16).to(torch.int32).view(torch.float32)
    lo, hi = _neighbours(x[below])
    yd = y[below].double()
    assert ((yd == lo) | (yd == hi)).all()
    assert (_u16(y[~below]) == BF16_MAX).all()


def test_reproducible_and_shape():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 53, generator=gen)
    idx = torch.arange(x.numel()).view(37, 53)
    a = stochastic_round_bf16(x, sr_bits(11, 5, idx))
    assert a.shape == x.shape and a.dtype == torch.bfloat16
    assert torch.equal(_u16(a), _u16(stochastic_round_bf16(x, sr_bits(11, 5, idx))))
    # a slice rounded alone (a shard) equals the same elements rounded with the whole
    flat = x.flatten()
    part = stochastic_round_bf16(flat[500:900], sr_bits(11, 5, torch.arange(500, 900)))
    assert torch.equal(_u16(part), _u16(a.flatten()[500:900]))
    # non-contiguous input
    t = stochastic_round_bf16(x.t(), sr_bits(11, 5, idx.t()))
    assert torch.equal(_u16(t), _u16(a.t()))
    # another step gives other roundings (of the inexact elements, some differ)
    b = stochastic_round_bf16(x, sr_bits(11, 6, idx))
    assert not torch.equal(_u16(a), _u16(b))
    # a scalar bit word broadcasts
    assert stochastic_round_bf16(x, 0).shape == x.shape
    assert torch.equal(stochastic_round_bf16(x, 0).float(),
                       _f32(x.view(torch.int32).to(torch.int64) & 0xFFFF0000))


def test_rejects_wrong_dtypes():
    with pytest.raises(TypeError):
        stochastic_round_bf16(torch.ones(3, dtype=torch.float64), 0)
    with pytest.raises(TypeError):
        stochastic_round_bf16(torch.ones(3, dtype=torch.bfloat16), 0)
    with pytest.raises(TypeError):
        stochastic_round_bf16(torch.ones(3), torch.ones(3))
    with pytest.raises(RuntimeError):
        stochastic_round_bf16(torch.ones(3), torch.zeros(4, dtype=torch.int64))
