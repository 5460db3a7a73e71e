"""The fused AdamW Triton kernel (zerokern/kernels/triton/adamw.py) under the Triton
interpreter, without a GPU: against a float64 reference of the same inputs, bit for bit
against a numpy emulation of the rounding contract of csrc/kernels.h (its exact fp32 FMA is
checked against rational arithmetic in test_triton_adamw_fma.py), bit for bit against the
native CPU kernel, and the 16-bit parameter copy against ``param.to(lp)`` on crafted bit
patterns.

The checks run in a subprocess with TRITON_INTERPRET=1 (see triton_common.py); the tests below
assert on the failures and case counts it reports. Its codegen for sm_90 is checked in
test_triton_compile.py.
"""

from __future__ import annotations

import pytest
import triton_common
from references import reference64
from test_triton_adamw_fma import _fma32
from triton_common import Group, assert_group
from triton_common import bits as _bits
from triton_common import start_scripts as start_scripts  # conftest starts the subprocess

# ----------------------------------------------------------------------------------------
# Script side: run under the interpreter by triton_common
# ----------------------------------------------------------------------------------------





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
    f64, emu, lpg = Group(), Group(), Group()
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
        rp, rm, rv = reference64(p, g, m, v, **hp)
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



def _interp_vs_cpu(out):
    """Triton (interpreted) and the native CPU kernel follow the same rounding contract:
    fused_adamw_ with backend="triton" and backend="cpu" agree bit for bit."""
    import torch

    from zerokern import _native
    from zerokern.ops import fused_adamw_

    if not _native.has_native():
        out["adamw_vs_cpu"] = {"skip": "zerokern._C is not built"}
        return
    grp = Group()
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




CHECKS = {"interp": (("adamw", _interp_adamw), ("adamw_vs_cpu", _interp_vs_cpu))}


# ----------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interp():
    return triton_common.results("interp", __file__)


def test_adamw_vs_float64(interp):
    assert_group(interp, "adamw_f64", 100)


def test_adamw_bitwise_vs_fp32_op_sequence(interp):
    assert_group(interp, "adamw_emulation", 100)


def test_adamw_fma_contract_matters(interp):
    # The contract's FMAs change the result of some elements: the bitwise emulation check
    # above could not pass with an unfused kernel.
    assert interp["adamw_unfused_diffs"] > 0


def test_adamw_triton_vs_cpu_bitwise(interp):
    res = interp["adamw_vs_cpu"]
    if "skip" in res:
        pytest.skip(res["skip"])
    assert_group(interp, "adamw_vs_cpu", 50)


def test_adamw_param_lp_bitwise(interp):
    assert_group(interp, "adamw_lp", 60)
