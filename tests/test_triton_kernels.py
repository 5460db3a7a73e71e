"""Triton kernels (fused AdamW, sq_norm, copy_segments) without a GPU.

* Logic: the kernels run under the Triton interpreter on CPU tensors. TRITON_INTERPRET must
  be set before triton is first imported, and other tests of this pytest process may have
  imported it already, so this file runs itself as a script in a subprocess
  (``TRITON_INTERPRET=1 python tests/test_triton_kernels.py interp``); the script prints
  one JSON line of per-group failures and case counts, which the tests below assert on.
* Codegen: each kernel is compiled for Hopper, GPUTarget("cuda", 90, 32), in a second
  subprocess without the interpreter (``python tests/test_triton_kernels.py compile``):
  no GPU is needed, only ptxas (shipped in triton/backends/nvidia/bin). The tests check
  that cubin/PTX were produced and inspect the AdamW PTX/SASS (128-bit vector accesses,
  IEEE sqrt/div, exactly the three fma.rn.f32 per element of the rounding contract in
  csrc/kernels.h and no other contraction, no spills).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
TIMEOUT_S = 600


# ----------------------------------------------------------------------------------------
# Script side: interpreter checks
# ----------------------------------------------------------------------------------------


def _reference64(p, g, m, v, *, lr, b1, b2, eps, wd, step, grad_scale):
    """The kernels.h formula in float64 on the same fp32 inputs."""
    p, m, v = p.double(), m.double(), v.double()
    g = g.double() / grad_scale
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = v.sqrt() / (1 - b2**step) ** 0.5 + eps
    p = p - lr / (1 - b1**step) * m / denom
    return p, m, v


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


def _emulate_fp32(p, g, m, v, k, fused=True):
    """The kernel's op sequence in numpy fp32: the contract of csrc/kernels.h (the lerp,
    the v update and the p update as exact fma, every other op rounded on its own).
    fused=False: the same formula with every op rounded on its own (the pre-contract
    Triton kernel), used only to show the bitwise check can tell the two apart."""
    import numpy as np

    f = np.float32
    p, m, v = p.numpy().copy(), m.numpy().copy(), v.numpy().copy()
    g = g.float().numpy()
    if k["APPLY_SCALE"]:
        g = g * f(k["inv_grad_scale"])
    p = p * f(k["decay"])
    d = g - m
    # The kernel gets -(1-w) and -step_size as int32 bit patterns.
    neg_omw = np.array([k["neg_one_minus_w_bits"]], dtype=np.int32).view(np.float32)[0]
    neg_step = np.array([k["neg_step_size_bits"]], dtype=np.int32).view(np.float32)[0]
    if fused:
        m = _fma32(f(k["w"]), d, m) if k["LERP_LOW"] else _fma32(-d, -neg_omw, g)
        v = _fma32(f(k["one_minus_beta2"]) * g, g, v * f(k["beta2"]))
        denom = np.sqrt(v) / f(k["bc2_sqrt"]) + f(k["eps"])
        p = _fma32(neg_step, m / denom, p)
    else:
        m = m + f(k["w"]) * d if k["LERP_LOW"] else g - d * (-neg_omw)
        v = v * f(k["beta2"]) + (f(k["one_minus_beta2"]) * g) * g
        denom = np.sqrt(v) / f(k["bc2_sqrt"]) + f(k["eps"])
        p = p - ((-neg_step) * m) / denom
    return p, m, v


class _Group:
    """Collects failures of one group of cases."""

    def __init__(self):
        self.cases = 0
        self.failures: list[str] = []

    def check(self, name, fn, *args):
        self.cases += 1
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - every failure is reported by name
            self.failures.append(f"{name}: {type(e).__name__}: {e}"[:2000])

    def result(self):
        return {"cases": self.cases, "failures": self.failures}


def _bits(t):
    import torch

    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def vs_f64(got, refs, g, g0):
    import torch
    from _tol import ADAM_FP32

    for t, ref in zip(got, refs):
        torch.testing.assert_close(t.double(), ref, rtol=ADAM_FP32[0], atol=ADAM_FP32[1])
    assert torch.equal(g, g0), "grad modified"


def vs_emulation(got, refs):
    import numpy as np

    for what, t, ref in zip(("param", "exp_avg", "exp_avg_sq"), got, refs):
        bad = np.flatnonzero(t.numpy().view(np.int32) != ref.view(np.int32))
        assert bad.size == 0, f"{what}: {bad.size} elements differ, first at {bad[:5]}"


def lp_bitwise(param_lp, p):
    import torch

    assert torch.equal(_bits(param_lp), _bits(p.to(param_lp.dtype))), "param_lp != param.to(lp)"


def _interp_adamw(out):
    import torch

    from zerokern.kernel_contract import adam_scalars
    from zerokern.kernels.triton import adamw as ka

    assert ka._INTERPRETED, "TRITON_INTERPRET=1 was not in effect"
    f64, emu, lpg = _Group(), _Group(), _Group()
    gdtypes = [torch.float32, torch.bfloat16, torch.float16]
    lps = [None, torch.bfloat16, torch.float16]
    hps = [  # (beta1, weight_decay, step, grad_scale)
        (0.9, 0.0, 1, 1.0),
        (0.9, 0.1, 1000, 1024.0),
        (0.9, 0.1, 1, 1024.0),
        (0.9, 0.0, 1000, 1.0),
        (0.3, 0.1, 10, 1.0),  # w = 0.7: the other lerp branch
    ]
    configs = [(n, gd, lp, hp) for n in (1, 7, 4099) for gd in gdtypes for lp in lps for hp in hps]
    configs += [(65539, gd, torch.bfloat16, hps[1]) for gd in gdtypes]
    configs += [(65539, torch.float32, None, hps[4])]
    unfused_diffs = 0  # elements where the contract's FMAs change the emulated result
    for n, gdtype, lp, (b1, wd, step, gs) in configs:
        name = f"n={n} grad={gdtype} lp={lp} b1={b1} wd={wd} step={step} scale={gs}"
        gen = torch.Generator().manual_seed(n + step)
        p = torch.randn(n, generator=gen)
        g = (torch.randn(n, generator=gen) * 3 * gs).to(gdtype)
        m = torch.randn(n, generator=gen) * 0.1
        v = torch.rand(n, generator=gen) * 0.01
        hp = dict(lr=1e-3, b1=b1, b2=0.999, eps=1e-8, wd=wd, step=step, grad_scale=gs)
        s = adam_scalars(
            lr=1e-3, beta1=b1, beta2=0.999, eps=1e-8, weight_decay=wd, step=step, grad_scale=gs
        )
        rp, rm, rv = _reference64(p, g, m, v, **hp)
        ep, em, ev = _emulate_fp32(p, g, m, v, ka.kernel_scalars(s))
        up, um, uv = _emulate_fp32(p, g, m, v, ka.kernel_scalars(s), fused=False)
        unfused_diffs += sum(int((x != y).sum()) for x, y in ((ep, up), (em, um), (ev, uv)))
        g0 = g.clone()
        param_lp = None if lp is None else torch.full((n,), 7.0, dtype=lp)
        ka.adamw_triton_(p, g, m, v, param_lp, s)
        f64.check(name, vs_f64, (p, m, v), (rp, rm, rv), g, g0)
        emu.check(name, vs_emulation, (p, m, v), (ep, em, ev))
        if lp is not None:
            lpg.check(name, lp_bitwise, param_lp, p)

    # n == 0: no launch, no error.
    e = torch.empty(0)
    f64.check(
        "n=0",
        lambda: ka.adamw_triton_(
            e,
            e.clone(),
            e.clone(),
            e.clone(),
            None,
            adam_scalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1),
        ),
    )

    # Rounding of param_lp on crafted bit patterns: lr = 0 gives decay = 1 and step_size = 0,
    # so the step leaves every param bit pattern as it is and param_lp = round(param).
    specials = [
        0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # bf16 ties to even / just off
        0x3FFFFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x477FF000,  # carry into exponent, overflow
        0x477FEFFF, 0x38000000, 0x33800000, 0x33000001,  # fp16 max / subnormal edges
        0x3F801000, 0x3F803000, 0x3FFFF000, 0x33000000,  # fp16 ties to even, carry
        0x33C00000, 0x387FE000, 0x477FF001,  # fp16 subnormal ties, overflow
        0x00000001, 0x00008000, 0x00018000, 0x007FFFFF,  # fp32 subnormals
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
        0x7FC00000, 0x7F800001, 0xFFC00000,  # NaNs
    ]  # fmt: skip
    special = torch.tensor(specials, dtype=torch.int64)
    special = torch.cat([special, special | (1 << 31)]).to(torch.int32)
    rnd = torch.randint(-(2**31), 2**31, (4099,), generator=torch.Generator().manual_seed(1))
    bits = torch.cat([special, rnd.to(torch.int32)])
    for lp in (torch.bfloat16, torch.float16):
        n = bits.numel()
        p = bits.clone().view(torch.float32)
        m, v, g = torch.ones(n), torch.ones(n), torch.zeros(n)
        param_lp = torch.zeros(n, dtype=lp)
        s = adam_scalars(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1)
        ka.adamw_triton_(p, g, m, v, param_lp, s)

        def crafted(p=p, param_lp=param_lp, lp=lp):
            ref = bits.view(torch.float32)
            nan = torch.isnan(ref)
            assert torch.equal(_bits(p)[~nan], bits[~nan]), "param changed with lr=0"
            want = ref.to(lp)
            assert torch.equal(torch.isnan(param_lp), nan), "NaN positions differ"
            got_b, want_b = _bits(param_lp)[~nan], _bits(want)[~nan]
            bad = torch.nonzero(got_b != want_b).flatten()[:5].tolist()
            assert not bad, f"lp bits differ at {bad}: {got_b[bad]} vs {want_b[bad]}"

        lpg.check(f"crafted bit patterns -> {lp}", crafted)

    out["adamw_f64"], out["adamw_emulation"], out["adamw_lp"] = (
        f64.result(),
        emu.result(),
        lpg.result(),
    )
    out["adamw_unfused_diffs"] = unfused_diffs


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

    grp = _Group()
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


def _interp_vs_cpu(out):
    """Triton (interpreted) and the native CPU kernel follow the same rounding contract:
    fused_adamw_ with backend="triton" and backend="cpu" agree bit for bit."""
    import torch

    from zerokern import _native
    from zerokern.ops import fused_adamw_

    if not _native.has_native():
        out["adamw_vs_cpu"] = {"skip": "zerokern._C is not built"}
        return
    grp = _Group()
    gdtypes = [torch.float32, torch.bfloat16, torch.float16]
    hps = [  # (beta1, weight_decay, step, grad_scale)
        (0.9, 0.1, 1000, 1024.0),
        (0.9, 0.0, 1, 1.0),
        (0.3, 0.1, 10, 1.0),  # w = 0.7: the other lerp branch
    ]
    # 7 and 4099: AVX2 body and scalar tail; 65539: the OpenMP split as well.
    configs = [
        (n, gd, lp, hp)
        for n in (7, 4099)
        for gd in gdtypes
        for lp in (None, torch.bfloat16, torch.float16)
        for hp in hps
    ]
    configs += [
        (65539, gd, lp, hps[0])
        for gd, lp in (
            (torch.float32, None),
            (torch.bfloat16, torch.bfloat16),
            (torch.float16, torch.float16),
        )
    ]
    configs += [(65539, torch.float32, torch.bfloat16, hps[2])]
    for n, gdtype, lp, (b1, wd, step, gs) in configs:
        name = f"n={n} grad={gdtype} lp={lp} b1={b1} wd={wd} step={step} scale={gs}"
        gen = torch.Generator().manual_seed(3 * n + step)
        p = torch.randn(n, generator=gen)
        g = (torch.randn(n, generator=gen) * 3 * gs).to(gdtype)
        m = torch.randn(n, generator=gen) * 0.1
        v = torch.rand(n, generator=gen) * 0.01
        lp_t = None if lp is None else torch.zeros(n, dtype=lp)
        hp = dict(lr=1e-3, beta1=b1, beta2=0.999, eps=1e-8, weight_decay=wd, step=step)
        res = {}
        for backend in ("triton", "cpu"):
            st = [p.clone(), m.clone(), v.clone(), None if lp_t is None else lp_t.clone()]
            fused_adamw_(
                st[0], g, st[1], st[2], grad_scale=gs, param_lp=st[3], backend=backend, **hp
            )
            res[backend] = st

        def same(res=res):
            for what, a, b in zip(("param", "exp_avg", "exp_avg_sq", "param_lp"), *res.values()):
                if a is None:
                    continue
                bad = torch.nonzero(_bits(a) != _bits(b)).flatten()
                assert torch.equal(_bits(a), _bits(b)), (
                    f"{what}: {bad.numel()} elements differ, first at {bad[:5].tolist()}: "
                    f"triton {a[bad[:5]].tolist()} cpu {b[bad[:5]].tolist()}"
                )

        grp.check(name, same)
    out["adamw_vs_cpu"] = grp.result()


def _interp_sq_norm(out):
    import torch
    from _tol import SQ_NORM

    from zerokern.kernels.triton import sq_norm as ks

    grp, special = _Group(), _Group()
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


def _interp_flatten(out):
    import torch

    from zerokern.kernels.triton import flatten as kf

    grp = _Group()
    widths: set[int] = set()
    sentinel = -7

    def round_trip(name, srcs, pad_elems):
        """Pack srcs back to back into two buckets (the largest tensor split across them),
        optionally padding each offset to pad_elems; scatter back into fresh tensors."""
        dt = srcs[0].dtype
        big = max(range(len(srcs)), key=lambda i: srcs[i].numel())
        split = srcs[big].numel() // 3 + 1
        pieces = []  # (src view, bucket index)
        for i, t in enumerate(srcs):
            if i == big:
                pieces += [(t[:split], 0), (t[split:], 1)]
            else:
                pieces.append((t, 0 if i < big else 1))

        def pad(o):
            return -(-o // pad_elems) * pad_elems

        offsets, sizes = [], [1, 1]  # start each bucket 1 element in: unaligned for odd pads
        for t, b in pieces:
            o = pad(sizes[b])
            offsets.append(o)
            sizes[b] = o + t.numel()
        buckets = [torch.full((sz + 3,), sentinel, dtype=dt) for sz in sizes]
        segs = [(t, buckets[b][o : o + t.numel()]) for (t, b), o in zip(pieces, offsets)]
        outs = [torch.empty_like(t) for t in srcs]
        back = []
        for i, t in enumerate(outs):
            if i == big:
                back += [t[:split], t[split:]]
            else:
                back.append(t)
        back_segs = [(d, o) for (_, d), o in zip(segs, back)]

        def chk():
            table = kf.build_table(segs) + kf.build_table(back_segs)
            widths.update(table[3 :: kf.ROW])
            kf.copy_segments_triton(segs)
            covered = [torch.zeros(b.numel(), dtype=torch.bool) for b in buckets]
            for (t, b), o in zip(pieces, offsets):
                assert torch.equal(buckets[b][o : o + t.numel()], t), "bucket content"
                covered[b][o : o + t.numel()] = True
            for b, c in zip(buckets, covered):
                assert bool((b[~c] == sentinel).all()), "copy wrote outside its segment"
            kf.copy_segments_triton(back_segs)
            for t, o in zip(srcs, outs):
                assert torch.equal(t, o), "round trip"

        grp.check(name, chk)

    for dt in (torch.float32, torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(0)
        srcs = [torch.randn(n, generator=gen).to(dt) for n in (1, 7, 4099, 65539, 3)]
        for pad in (1, 16 // srcs[0].element_size()):
            round_trip(f"{dt} pad={pad}", srcs, pad)
        # sub-ranges of one tensor at odd offsets on both sides
        base = torch.randn(5000, generator=gen).to(dt)
        round_trip(f"{dt} views of one tensor", [base[1:4000], base[4001:4002], base[4003:]], 1)

    # Raw bytes, any alignment: equal misalignment mod 16 (head + 16-byte body + tail),
    # different misalignment (byte path), empty segments and an empty list.
    u = torch.randint(0, 256, (70000,), dtype=torch.uint8, generator=torch.Generator())
    dst = torch.zeros(140000, dtype=torch.uint8)
    segs = [
        (u[3:66000], dst[19:66016]),  # 3 == 19 mod 16
        (u[5:1000], dst[70002:70997]),  # 5 vs 2 mod 16
        (u[7:7], dst[80000:80000]),
        (u[0:1], dst[90001:90002]),
        (u[100:117], dst[100000:100017]),  # aligned start, 17 bytes
    ]

    def raw():
        widths.update(kf.build_table(segs)[3 :: kf.ROW])
        kf.copy_segments_triton(segs)
        kf.copy_segments_triton([])
        for s, d in segs:
            assert torch.equal(s, d)
        mask = torch.ones(dst.numel(), dtype=torch.bool)
        for _, d in segs:
            off = d.data_ptr() - dst.data_ptr()
            mask[off : off + d.numel()] = False
        assert bool((dst[mask] == 0).all()), "copy wrote outside its segment"

    grp.check("raw bytes", raw)
    out["flatten"] = grp.result()
    out["flatten_widths"] = sorted(int(w) for w in widths)


def _script_interp():
    import time

    import torch

    from zerokern.kernels.triton import interpreter_problem

    why = interpreter_problem()
    if why is not None:
        print(json.dumps({"skip": why}))
        return
    torch.set_num_threads(int(os.environ.get("ZEROKERN_TEST_THREADS", 0))
                          or min(2, os.cpu_count() or 1))
    out, times = {}, {}
    for name, fn in (
        ("adamw", _interp_adamw),
        ("fma", _interp_fma),
        ("adamw_vs_cpu", _interp_vs_cpu),
        ("sq_norm", _interp_sq_norm),
        ("flatten", _interp_flatten),
    ):
        t0 = time.perf_counter()
        fn(out)
        times[name] = round(time.perf_counter() - t0, 2)
    out["seconds"] = times
    print(json.dumps(out))


# ----------------------------------------------------------------------------------------
# Script side: compile for sm_90
# ----------------------------------------------------------------------------------------

PTX_PATTERNS = (
    "ld.global.v4",
    "ld.global.v2",
    "st.global.v4",
    "st.global.v2",
    "sqrt.rn.f32",
    "sqrt.approx",
    "div.rn.f32",
    "div.full",
    "div.approx",
    "fma.rn.f32",
    "mul.rn.f32",
    "add.rn.f32",
    "sub.rn.f32",
    "mul.f32",  # no rounding modifier: ptxas may contract these into an FMA
    "add.f32",
    "sub.f32",
    "cvt.rn.bf16.f32",
    "cvt.rn.f16.f32",
    ".ftz",
    ".f64",
    "neg.f32",
)


def _compile_one(fn, signature, constexprs, options, aligned_ptrs=(), sass=False):
    import re

    import triton
    from triton.backends.compiler import GPUTarget

    attrs = {(list(signature).index(a),): [["tt.divisibility", 16]] for a in aligned_ptrs}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = k.asm.get("ptx", "")
    cubin = k.asm.get("cubin", b"")
    info = {
        "asm": sorted(k.asm),
        "ptx_chars": len(ptx),
        "cubin_bytes": len(cubin),
        "sm_90": ".target sm_90" in ptx,
        "ptx": {p: len(re.findall(re.escape(p), ptx)) for p in PTX_PATTERNS},
        "shared": int(getattr(k.metadata, "shared", -1)),
        "resources": _resource_usage(cubin),
    }
    if sass:
        try:
            from triton.tools.disasm import get_sass

            text = get_sass(cubin)
            ops = re.findall(r"\b((?:LDG|STG|LDS|STS|LDL|STL)(?:\.[A-Z0-9]+)*)", text)
            info["sass"] = {o: ops.count(o) for o in sorted(set(ops))}
        except Exception as e:  # noqa: BLE001 - SASS is informative only
            info["sass_error"] = repr(e)[:300]
    return info


def _resource_usage(cubin):
    """REG / LOCAL (spill) / SHARED of the cubin, from cuobjdump -res-usage if available."""
    import re
    import tempfile

    try:
        from triton import knobs

        tool = knobs.nvidia.cuobjdump.path
    except Exception:  # noqa: BLE001
        tool = None
    if not tool or not os.path.exists(tool) or not cubin:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", r.stdout)
    if m is None:
        return None
    return dict(zip(("reg", "stack", "shared", "local"), map(int, m.groups())))


def _script_compile():
    import time

    import triton

    out = {"triton": triton.__version__}
    try:
        backends = triton.backends.backends
        if "nvidia" not in backends:
            print(json.dumps({"skip": "triton has no nvidia backend"}))
            return
        try:
            from triton.backends.nvidia.compiler import get_ptxas

            ptxas = get_ptxas(90).path
        except (ImportError, AttributeError, TypeError):
            ptxas = None  # another triton version: let the compile itself tell
        except Exception as e:  # noqa: BLE001 - knobs raise when ptxas cannot be found
            print(json.dumps({"skip": f"ptxas for sm_90 unavailable: {e!r}"[:500]}))
            return
        if ptxas is not None and not os.path.exists(ptxas):
            print(json.dumps({"skip": f"ptxas not found at {ptxas}"}))
            return
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"skip": f"CUDA backend unusable: {e!r}"[:500]}))
        return

    from zerokern.kernels.triton import adamw as ka
    from zerokern.kernels.triton import flatten as kf
    from zerokern.kernels.triton import sq_norm as ks

    assert not ka._INTERPRETED
    t0 = time.perf_counter()
    scalars = "decay w beta2 one_minus_beta2 bc2_sqrt eps inv_grad_scale"
    bit_scalars = "neg_one_minus_w_bits neg_step_size_bits"
    kernels = {}
    adam_ptrs = ("param_ptr", "grad_ptr", "exp_avg_ptr", "exp_avg_sq_ptr", "lp_ptr")

    def adam(gd, lp, i64=False, lerp_low=True, scale=True, aligned=True):
        sig = {
            "param_ptr": "*fp32",
            "grad_ptr": f"*{gd}",
            "exp_avg_ptr": "*fp32",
            "exp_avg_sq_ptr": "*fp32",
            "lp_ptr": f"*{lp or 'fp32'}",
            "n": "i64" if i64 else "i32",
            **{s: "fp32" for s in scalars.split()},
            **{s: "i32" for s in bit_scalars.split()},
            **{c: "constexpr" for c in ("BLOCK", "HAS_LP", "LERP_LOW", "APPLY_SCALE")},
            **{c: "constexpr" for c in ("USE_INT64", "SOFT_FP")},
        }
        cx = dict(
            BLOCK=ka.BLOCK,
            HAS_LP=lp is not None,
            LERP_LOW=lerp_low,
            APPLY_SCALE=scale,
            USE_INT64=i64,
            SOFT_FP=False,
        )
        ptrs = adam_ptrs if aligned else ()
        return _compile_one(ka.adamw_kernel, sig, cx, dict(ka.COMPILE_OPTIONS), ptrs, sass=True)

    for gd in ("fp32", "bf16", "fp16"):
        for lp in (None, "bf16", "fp16"):
            kernels[f"adamw grad={gd} lp={lp}"] = adam(gd, lp)
    kernels["adamw grad=bf16 lp=bf16 int64 w>=0.5 unscaled"] = adam(
        "bf16", "bf16", i64=True, lerp_low=False, scale=False
    )
    kernels["adamw grad=fp32 lp=None unaligned"] = adam("fp32", None, aligned=False)
    for dt in ("fp32", "bf16", "fp16"):
        for i64 in (False, True):
            kernels[f"sq_norm_partials {dt} int64={i64}"] = _compile_one(
                ks.sq_norm_partials_kernel,
                {
                    "x_ptr": f"*{dt}",
                    "partials_ptr": "*fp32",
                    "n": "i64" if i64 else "i32",
                    "BLOCK": "constexpr",
                    "USE_INT64": "constexpr",
                },
                dict(BLOCK=ks.BLOCK, USE_INT64=i64),
                dict(num_warps=ks.NUM_WARPS),
                ("x_ptr", "partials_ptr"),
            )
    kernels["sq_norm_final"] = _compile_one(
        ks.sq_norm_final_kernel,
        {"partials_ptr": "*fp32", "out_ptr": "*fp32", "num_partials": "i32", "BLOCK": "constexpr"},
        dict(BLOCK=ks.MAX_PARTIALS),
        dict(num_warps=4),
        ("partials_ptr", "out_ptr"),
    )
    kernels["copy_chunks"] = _compile_one(
        kf.copy_chunks_kernel,
        {"table_ptr": "*i64", "TILE": "constexpr", "SUB": "constexpr"},
        dict(TILE=kf.TILE, SUB=32 * kf.NUM_WARPS),
        dict(num_warps=kf.NUM_WARPS),
        ("table_ptr",),
        sass=True,
    )
    out["kernels"] = kernels
    out["adamw_block"], out["adamw_num_warps"] = ka.BLOCK, ka.NUM_WARPS
    out["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))


# ----------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------


_STARTED: dict[str, tuple[subprocess.Popen, object, object, float]] = {}


def start_script(mode: str, interpret: bool) -> None:
    """Start `mode` in the background (conftest does so right after collection: the scripts
    take 30-40 s of one core, which the rest of the suite leaves partly idle)."""
    if mode in _STARTED:
        return
    import tempfile
    import time

    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1" if interpret else "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, str(HERE), mode], cwd=ROOT, env=env,
                            stdout=out, stderr=err, text=True)
    _STARTED[mode] = (proc, out, err, time.monotonic())


def start_scripts(items) -> None:
    names = {n for item in items for n in getattr(item, "fixturenames", ())}
    if "interp" in names:
        start_script("interp", interpret=True)
    if "compiled" in names:
        start_script("compile", interpret=False)


def _run_script(mode: str, interpret: bool) -> dict:
    import time

    start_script(mode, interpret)
    proc, out, err, t0 = _STARTED[mode]
    try:
        proc.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(f"`{mode}` subprocess failed (rc={proc.returncode}):\n{stderr[-6000:]}")
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def interp():
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    res = _run_script("interp", interpret=True)
    if "skip" in res:
        pytest.skip(res["skip"])
    return res


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton")
    res = _run_script("compile", interpret=False)
    if "skip" in res:
        pytest.skip(res["skip"])
    return res


def _assert_group(res, key, min_cases):
    g = res[key]
    assert not g["failures"], f"{len(g['failures'])} of {g['cases']} failed:\n" + "\n".join(
        g["failures"][:20]
    )
    assert g["cases"] >= min_cases, g


def test_adamw_vs_float64(interp):
    _assert_group(interp, "adamw_f64", 100)


def test_adamw_bitwise_vs_fp32_op_sequence(interp):
    _assert_group(interp, "adamw_emulation", 100)


def test_adamw_fma_contract_matters(interp):
    # The contract's FMAs change the result of some elements: the bitwise emulation check
    # above could not pass with an unfused kernel.
    assert interp["adamw_unfused_diffs"] > 0


def test_fma_emulation_exact(interp):
    _assert_group(interp, "fma", 6)


def test_adamw_triton_vs_cpu_bitwise(interp):
    res = interp["adamw_vs_cpu"]
    if "skip" in res:
        pytest.skip(res["skip"])
    _assert_group(interp, "adamw_vs_cpu", 50)


def test_adamw_param_lp_bitwise(interp):
    _assert_group(interp, "adamw_lp", 60)


def test_sq_norm(interp):
    _assert_group(interp, "sq_norm", 30)


def test_sq_norm_inf_nan(interp):
    _assert_group(interp, "sq_norm_inf_nan", 30)


def test_copy_segments(interp):
    _assert_group(interp, "flatten", 10)
    # Every access width of the copy kernel was exercised.
    assert interp["flatten_widths"] == [1, 2, 4, 16], interp["flatten_widths"]
    print("interpreter seconds:", interp["seconds"])


def test_compile_sm90_all_kernels(compiled):
    for name, k in compiled["kernels"].items():
        assert k["cubin_bytes"] > 0 and k["ptx_chars"] > 0, (name, k["asm"])
        assert k["sm_90"], name
        res = k["resources"]
        if res is not None:
            assert res["local"] == 0, f"{name} spills: {res}"


def test_compile_sm90_adamw_codegen(compiled):
    ka_block, ka_warps = compiled["adamw_block"], compiled["adamw_num_warps"]
    lines = [f"triton {compiled['triton']}, compile {compiled['seconds']} s"]
    for name, k in compiled["kernels"].items():
        ptx = {p: c for p, c in k["ptx"].items() if c}
        sass, res = k.get("sass"), k["resources"]
        lines.append(f"{name}: ptx {ptx} sass {sass} res {res} smem {k['shared']}")
        if not name.startswith("adamw"):
            continue
        # The rounding contract of csrc/kernels.h, per element, as properties that hold
        # whatever the Triton version's lowering: exactly three fma.rn.f32 (lerp, v update,
        # p update) and no other contraction; at least the muls g*inv_scale (when scaled),
        # p*decay, (1-b2)*g and v*b2, the sub g-m and the add +eps, each rounded on its own
        # (.rn: ptxas must not contract them); IEEE sqrt and both divisions; no fp64 and no
        # flush-to-zero. Each thread owns BLOCK / (32 * NUM_WARPS) elements, in the unmasked
        # and in the masked path. (Exact counts of the other ops differ between Triton 3.6
        # and 3.8, e.g. how a select or a constant is materialised.)
        per = 2 * ka_block // (32 * ka_warps)
        scaled = "unscaled" not in name
        assert ptx.get("fma.rn.f32", 0) == 3 * per, (name, ptx)
        at_least = {
            "mul.rn.f32": (4 if scaled else 3) * per,
            "sub.rn.f32": per,
            "add.rn.f32": per,
            "sqrt.rn.f32": per,
            "div.rn.f32": 2 * per,
        }
        short = {op: ptx.get(op, 0) for op, n in at_least.items() if ptx.get(op, 0) < n}
        assert not short, (name, short, at_least)
        for bad in ("sqrt.approx", "div.full", "div.approx", ".ftz", "mul.f32", "add.f32",
                    "sub.f32", ".f64"):
            assert not ptx.get(bad), (name, bad, ptx)
        if "lp=bf16" in name:
            assert ptx.get("cvt.rn.bf16.f32"), (name, ptx)
        if "unaligned" not in name:
            # The unmasked full-block path moves the fp32 state with 128-bit accesses.
            assert ptx.get("ld.global.v4", 0) >= 3 and ptx.get("st.global.v4", 0) >= 3, (name, ptx)
    copy = compiled["kernels"]["copy_chunks"]["ptx"]
    assert copy["ld.global.v4"] > 0 and copy["st.global.v4"] > 0, copy
    print("\n".join(lines))


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "interp"
    if mode == "interp":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("run with TRITON_INTERPRET=1")
        _script_interp()
    elif mode == "compile":
        _script_compile()
    else:
        sys.exit(f"unknown mode {mode!r}")
