"""The exact fp32 fused multiply-add the AdamW checks rely on: the numpy emulation _fma32 (the
oracle of test_triton_adamw.py's bitwise check of the rounding contract) against rational
arithmetic, on crafted cases where rounding through float64 would be wrong and on random
operands; and the AdamW kernel's interpreter FMA (adamw._fma with SOFT_FP) against it.

The checks run in a subprocess with TRITON_INTERPRET=1 (see triton_common.py); the test below
asserts on the failures and case counts it reports.
"""

from __future__ import annotations

import pytest
import triton_common
from triton_common import Group, assert_group
from triton_common import start_scripts as start_scripts  # conftest starts the subprocess

# ----------------------------------------------------------------------------------------
# Script side: run under the interpreter by triton_common
# ----------------------------------------------------------------------------------------


def _fma32(a, b, c):
    """fp32 fma(a, b, c) = a*b + c rounded once to nearest even, on numpy fp32 arrays.

    Exact by construction (numpy has no fma; Python 3.11 has no math.fma):
    * x = a*b + c is the exact value. a*b in float64 is exact: two 24-bit significands give
      at most 48 bits, and fp32 exponents (products within 2**-298 .. 2**256) stay in
      float64's normal range. So s = float64(a*b) + float64(c) is x rounded once to float64.
    * Let RN32 be fp32 round-to-nearest-even. RN32 is constant between consecutive fp32
      midpoints M (halfway between adjacent fp32 values, including the overflow threshold
      2**128 - 2**103), and each M has at most 25 significant bits, so is a float64.
      Rounding is monotonic and fixes representable values: x < M gives s <= M, x > M gives
      s >= M. Hence if s is no midpoint, x and s lie strictly on the same side of every M,
      and RN32(s) == RN32(x): numpy's float64 -> float32 cast (correctly rounded) is exact.
    * Where s is a midpoint (rare: about 2**-29 of random inputs, so crafted cases test
      it), x is computed exactly with fractions.Fraction and the fp32 neighbour of s on x's
      side is taken; x == s is a true tie and the cast's even choice stands.
    Non-finite s (inf/NaN inputs) is left to the cast, which is then exact too.
    """
    from fractions import Fraction

    import numpy as np

    a, b, c = (np.asarray(t, dtype=np.float32) for t in (a, b, c))
    a, b, c = np.broadcast_arrays(a, b, c)
    s = a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        r = s.astype(np.float32)
        r64 = r.astype(np.float64)
        # the other fp32 neighbour of s (r is the nearer one, or the even one on a tie);
        # r = +-inf from a finite s: count it as +-2**128 for the midpoint test.
        other = np.where(r64 < s, np.nextafter(r, np.float32(np.inf)), r)
        other = np.where(r64 > s, np.nextafter(r, np.float32(-np.inf)), other)
        r64 = np.where(np.isinf(r64) & np.isfinite(s), np.copysign(2.0**128, s), r64)
        # adjacent fp32 values: their sum is exact in float64 and halving it is exact
        mid = np.isfinite(s) & (r64 != s) & ((r64 + other.astype(np.float64)) / 2 == s)
    out = r.copy()
    for i in zip(*np.nonzero(mid)):
        x = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        if x != Fraction(float(s[i])):
            lo, hi = sorted((r[i], other[i]))
            out[i] = hi if x > Fraction(float(s[i])) else lo
    return out



def _fma_cases():
    """(a, b, c) fp32 arrays: crafted cases where a*b + c rounded to float64 lands exactly
    on an fp32 midpoint (double rounding through float64 would be wrong, or a true tie),
    with their exact answers, plus random operands of mixed magnitudes."""
    import numpy as np

    f = np.float32
    e = 2.0**-15
    crafted = [  # (a, b, c, exact fp32 fma)
        # x = 1 + 2**-24 + 2**-54: s = 1 + 2**-24 is a midpoint, x is above it
        (-(1 + e), 2.0**-24 * (1 - e), 1 + 2.0**-23, 1 + 2.0**-23),
        # x = 1 + 2**-24 - 2**-54: below the midpoint
        (1 + e, 2.0**-24 * (1 - e), 1.0, 1.0),
        # true ties: to even
        (1.0, 2.0**-24, 1.0, 1.0),
        (1.0, 2.0**-24, 1 + 2.0**-23, 1 + 2.0**-22),
        # the same, mirrored in sign
        ((1 + e), 2.0**-24 * (1 - e), -(1 + 2.0**-23), -(1 + 2.0**-23)),
        (-(1 + e), 2.0**-24 * (1 - e), -1.0, -1.0),
        (-1.0, 2.0**-24, -1.0, -1.0),
        # fp32 subnormal results (float64 holds these x exactly): just above the midpoint
        # 2**-150, and true ties to even
        (2.0**-75, 2.0**-75 * (1 + 2.0**-23), 0.0, 2.0**-149),
        (2.0**-75, 2.0**-75, 0.0, 0.0),
        (2.0**-75, 2.0**-75, 2.0**-149, 2.0**-148),
        # exact cancellation, and a plain product
        (3.0, float(f(1 / 3)), -1.0, 2.0**-25),  # 3 * f32(1/3) = 1 + 2**-25
        (0.5, 0.25, 0.0, 0.125),
    ]
    a, b, c, want = (np.array(col, dtype=np.float64) for col in zip(*crafted))
    assert all((x.astype(f).astype(np.float64) == x).all() for x in (a, b, c, want))
    gen = np.random.default_rng(0)
    n = 4000
    ra, rb, rc = (
        gen.standard_normal(n).astype(f) * f(2.0) ** gen.integers(-30, 30, n).astype(f)
        for _ in range(3)
    )
    rc[: n // 4] = -(ra[: n // 4] * rb[: n // 4])  # near-cancellation: fp32 product, exact c
    return (a.astype(f), b.astype(f), c.astype(f), want.astype(f)), (ra, rb, rc)


def _interp_fma(out):
    """The numpy _fma32 against exact rational arithmetic, and the kernel's interpreter
    FMA (adamw._fma with SOFT_FP) against _fma32, on crafted midpoint cases and random
    operands."""
    from fractions import Fraction

    import numpy as np
    import torch
    import triton
    import triton.language as tl

    from zerokern.kernels.triton import adamw as ka

    grp = Group()
    (ca, cb, cc, want), (ra, rb, rc) = _fma_cases()

    def exact_fp32(a, b, c):
        """RN32 of the exact a*b + c by rational arithmetic (slow: a few thousand only).
        The answer is r = float32(float64(x)) or one of its fp32 neighbours (see
        _fma32): take the one nearest to x, on a tie the one with an even significand."""
        res = []
        for x, y, z in zip(a.tolist(), b.tolist(), c.tolist()):
            q = Fraction(x) * Fraction(y) + Fraction(z)
            r = np.float32(float(q))  # float(Fraction) is correctly rounded to float64
            cands = [r, np.nextafter(r, np.float32(-np.inf)), np.nextafter(r, np.float32(np.inf))]
            dist = [abs(Fraction(float(t)) - q) for t in cands]
            best = min(dist)
            ties = [t for t, d in zip(cands, dist) if d == best]
            ties.sort(key=lambda t: int(np.array(t, dtype=np.float32).view(np.int32)) & 1)
            res.append(ties[0])  # nearest; on a tie the even significand
        return np.array(res, dtype=np.float32)

    def same_bits(got, ref, what):
        bad = np.flatnonzero(got.view(np.int32) != ref.view(np.int32))
        assert bad.size == 0, f"{what}: {bad.size} differ, first at {bad[:5]}: {got[bad[:5]]}"

    grp.check("crafted: numpy _fma32 == known", lambda: same_bits(_fma32(ca, cb, cc), want, ""))
    grp.check("crafted: exact_fp32 == known", lambda: same_bits(exact_fp32(ca, cb, cc), want, ""))

    def double_rounding_exercised():
        # case 0 through float64 and a plain cast rounds to 1.0; exact is 1 + 2**-23
        naive = (ca.astype(np.float64) * cb + cc.astype(np.float64)).astype(np.float32)
        assert naive[0] == 1.0 and want[0] == np.float32(1 + 2.0**-23), (naive[0], want[0])

    grp.check("crafted: naive float64 rounding is wrong on case 0", double_rounding_exercised)
    grp.check(
        "random: numpy _fma32 == Fraction",
        lambda: same_bits(_fma32(ra, rb, rc), exact_fp32(ra, rb, rc), "random"),
    )

    # The interpreter runs a kernel's source against its module globals (no closures).
    global _adamw_fma
    _adamw_fma = ka._fma

    @triton.jit
    def fma_kernel(a_ptr, b_ptr, c_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(a_ptr + offs, mask=mask)
        b = tl.load(b_ptr + offs, mask=mask)
        c = tl.load(c_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, _adamw_fma(a, b, c, True), mask=mask)

    def soft(a, b, c, ref, what):
        ta, tb, tc = (torch.from_numpy(np.ascontiguousarray(x)) for x in (a, b, c))
        o = torch.empty_like(ta)
        fma_kernel[(triton.cdiv(ta.numel(), 1024),)](ta, tb, tc, o, ta.numel(), BLOCK=1024)
        same_bits(o.numpy(), ref, what)

    grp.check("crafted: kernel _fma == known", soft, ca, cb, cc, want, "crafted")
    grp.check("random: kernel _fma == _fma32", soft, ra, rb, rc, _fma32(ra, rb, rc), "random")
    out["fma"] = grp.result()


_adamw_fma = None  # set by _interp_fma: adamw._fma, for its test kernel


CHECKS = {"interp": (("fma", _interp_fma),)}


# ----------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interp():
    return triton_common.results("interp", __file__)


def test_fma_emulation_exact(interp):
    assert_group(interp, "fma", 6)
