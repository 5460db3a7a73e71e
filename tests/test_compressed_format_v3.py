"""Format version 3 of the int8 moments (zerokern.quant.fmt_v3, issue 39): its computed maps,
its codes against an independent float64 nearest-value reference, its error bound, exact
re-encoding, the CPU and Triton kernels bit for bit against the oracle (``backend="torch"``)
over chained steps, every param mode, partial blocks, subnormal and zero scales, an inf block
and the NaN block it decodes to, block-split independence, and the refusals.

The Triton kernel runs the same cases (:data:`CASES`, :func:`chained_vs_oracle`) under the
interpreter, in the subprocess of triton_common (``CHECKS["interp"]``), plus its encoder and
decoder on every map value, midpoint and their fp32 neighbours; the CUDA kernel runs them in
test_gpu_adamw_compressed.py (on a GPU only)."""

from __future__ import annotations

import math

import pytest
import torch
import triton_common
from references import folded_update_steps
from triton_common import Group, assert_group
from triton_common import start_scripts as start_scripts  # conftest starts the subprocess

from zerokern import _native
from zerokern.kernel_contract import adam_scalars
from zerokern.ops import adamw_compressed as opmod
from zerokern.ops.adamw_compressed import fused_adamw_compressed_
from zerokern.quant.fmt_v3 import code_map_v3, codes_v3, quantize_blockwise_v3
from zerokern.quant.maps import BLOCK, dequantize_blockwise, kernel_tables

native = pytest.mark.skipif(
    not (_native.has_native() and hasattr(_native._C, "adamw_compressed")),
    reason="zerokern._C without the cpu adamw_compressed kernel",
)
MAG1 = {True: 1.25 * 2.0**-16, False: 1.25 * 2.0**-32}


def _nearest_code(n: float, signed: bool, table: list[float]) -> int:
    """Independent reference: round |n| to 3 mantissa bits in float64 (ties away from zero),
    0 below the smallest magnitude, capped at 1; the code is that value's index."""
    if math.isnan(n) or (not signed and (n < 0 or math.copysign(1.0, n) < 0)):
        return 128 if signed else 0
    a = abs(n)
    r = 0.0
    if a > 0:
        e = math.floor(math.log2(a))
        step = 2.0 ** (e - 3)
        r = math.floor(a / step + 0.5) * step
        r = 0.0 if r < MAG1[signed] else min(r, 1.0)
    value = -r if (signed and n < 0) else r
    return table.index(value) if value != 0 else (128 if signed else 0)


def _probe_values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    wide = torch.exp2(-40 * torch.rand(4000, generator=gen))
    parts = [torch.rand(4000, generator=gen) * 2 - 1,
             (torch.rand(4000, generator=gen) * 2 - 1) * wide]
    for signed in (True, False):  # every map value, every midpoint and their fp32 neighbours
        t = code_map_v3(signed).double()
        mids = ((t[1:] + t[:-1]) / 2).float()
        for x in (t.float(), mids):
            up, down = torch.tensor(2.0), torch.tensor(-2.0)
            parts += [x, torch.nextafter(x, up), torch.nextafter(x, down)]
    parts.append(torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0000001, -1.0000001, 2.0**-130,
                               -(2.0**-130), float("nan"), 1.1875 * 2**-16, 1.1875 * 2**-32]))
    return torch.cat(parts).float()


@pytest.mark.parametrize("signed", [True, False])
def test_maps_and_codes_match_the_float64_nearest_value(signed):
    t = code_map_v3(signed)
    assert t.shape == (256,) and bool((t[1:] > t[:-1]).all())
    table = t.tolist()
    if signed:
        assert table[255] == 1.0 and table[1] == -1.0 and table[0] == -1.125 and table[128] == 0
        assert table[129] == MAG1[True]
        assert torch.equal(t[129:], -t[1:128].flip(0))
    else:
        assert table[255] == 1.0 and table[0] == 0 and table[1] == MAG1[False]
    n = _probe_values()
    got = codes_v3(n, signed).tolist()
    want = [_nearest_code(x, signed, table) for x in n.double().tolist()]
    bad = [(x, g, w) for x, g, w in zip(n.tolist(), got, want) if g != w]
    assert not bad, f"{len(bad)} codes differ, e.g. {bad[:3]}"


@pytest.mark.parametrize("signed", [True, False])
def test_error_bound_and_exact_reencoding(signed):
    gen = torch.Generator().manual_seed(7)
    n = 50 * BLOCK + 37
    x = torch.randn(n, generator=gen) * torch.exp2(-30 * torch.rand(n, generator=gen))
    if not signed:
        x = x.abs()
    x[BLOCK:2 * BLOCK] = 0.0
    codes, scale = quantize_blockwise_v3(x, signed)
    y = dequantize_blockwise(codes, scale, code_map_v3(signed))
    s = scale.double().repeat_interleave(BLOCK)[:n]
    x64, err = x.double(), (y.double() - x.double()).abs()
    bound = x64.abs() / 16 + s * MAG1[signed] + 2.0**-21 * x64.abs() + 2.0**-149
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"
    assert torch.equal(y[BLOCK:2 * BLOCK], torch.zeros(BLOCK))
    codes2, scale2 = quantize_blockwise_v3(y, signed)
    assert torch.equal(codes2, codes) and torch.equal(scale2, scale)


def _state(n: int, pdtype: torch.dtype, lp: torch.dtype | None, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=gen) * 0.1 * torch.exp2(-10 * torch.rand(n, generator=gen))
    v = torch.rand(n, generator=gen) * 0.01 * torch.exp2(-20 * torch.rand(n, generator=gen))
    m[BLOCK:2 * BLOCK] *= 2.0**-128  # below the normal range: scales that divide
    v[BLOCK:2 * BLOCK] *= 2.0**-128
    em, am = quantize_blockwise_v3(m, True)
    ev, av = quantize_blockwise_v3(v, False)
    nb = -(-n // BLOCK)
    return dict(param=torch.randn(n, generator=gen).to(pdtype), exp_avg=em, exp_avg_sq=ev,
                exp_avg_absmax=am, exp_avg_sq_absmax=av,
                param_lp=None if lp is None else torch.zeros(n, dtype=lp),
                sr_index=(torch.arange(nb, dtype=torch.int64) * 3 * BLOCK + 5
                          if pdtype == torch.bfloat16 else None))


def _step(st: dict, grad: torch.Tensor, step: int, backend: str, beta1: float = 0.9) -> None:
    fused_adamw_compressed_(
        st["param"], grad, st["exp_avg"], st["exp_avg_sq"], lr=1e-2, beta1=beta1, beta2=0.999,
        eps=1e-8, weight_decay=0.1, step=step, exp_avg_absmax=st["exp_avg_absmax"],
        exp_avg_sq_absmax=st["exp_avg_sq_absmax"], param_lp=st["param_lp"],
        sr_index=st["sr_index"], seed=2**63 + 9 if st["sr_index"] is not None else None,
        backend=backend, format_version=3)


def _same(a: dict, b: dict) -> None:
    for k, t in a.items():
        if isinstance(t, torch.Tensor) and k != "sr_index":
            t, u = t.cpu(), b[k].cpu()
            assert torch.equal(torch.isnan(t.float()), torch.isnan(u.float())), k
            ok = ~torch.isnan(t.float())
            assert torch.equal(t[ok], u[ok]), f"{k}: {(t[ok] != u[ok]).sum().item()} differ"


# (param dtype, param_lp dtype, grad dtype, n, beta1): every param mode, partial last blocks,
# both lerp forms; the last one spans several of the CPU kernel's OpenMP chunks (2**15).
CASES = [
    (torch.float32, torch.bfloat16, torch.bfloat16, 5 * BLOCK + 77, 0.9),
    (torch.float32, None, torch.float32, 3 * BLOCK, 0.3),
    (torch.float32, torch.float16, torch.float16, BLOCK + 13, 0.9),
    (torch.bfloat16, None, torch.bfloat16, 4 * BLOCK + 100, 0.9),
    (torch.float32, torch.bfloat16, torch.float32, 130 * BLOCK + 9, 0.9),
]


def chained_vs_oracle(backend: str, pdtype: torch.dtype, lp: torch.dtype | None,
                      gdtype: torch.dtype, n: int, beta1: float, device: str = "cpu") -> None:
    """Four chained steps of ``backend`` on ``device`` against the oracle on CPU, compared
    after each: a block whose gradient vanishes (step 2), a block of tiny gradients
    (subnormal scales: the divided normalisation), an inf gradient (step 3: inf scales, the
    element's moments NaN) and the NaN block that state decodes to (step 4)."""
    st = {k: (t.to(device) if isinstance(t, torch.Tensor) else t)
          for k, t in _state(n, pdtype, lp, seed=n).items()}
    ref = {k: (t.cpu().clone() if isinstance(t, torch.Tensor) else t) for k, t in st.items()}
    gen = torch.Generator().manual_seed(3)
    for step in (1, 2, 3, 4):
        g = (torch.randn(n, generator=gen) * torch.exp2(-12 * torch.rand(n, generator=gen)))
        if n > 2 * BLOCK:
            g[:BLOCK] = 0.0 if step == 2 else g[:BLOCK]  # a block that decays
            g[BLOCK:2 * BLOCK] *= 2.0**-140  # tiny: subnormal scales, the divided path
        if step == 3 and n > 3 * BLOCK:
            g[2 * BLOCK + 7] = float("inf")  # a non-finite block: inf scale, codes by rule
        g = g.to(gdtype)
        _step(st, g.to(device), step, backend, beta1)
        _step(ref, g, step, "torch", beta1)
        _same(st, ref)
        if step == 4 and n > 3 * BLOCK:
            assert torch.isnan(ref["exp_avg_absmax"][2]), "the NaN block was not reached"
    if n > 2 * BLOCK and gdtype != torch.float16:  # (fp16 flushes the tiny gradient to 0)
        tiny = ref["exp_avg_absmax"][1]
        assert 0 < tiny < 2.0**-126, "the divided path was not reached"


@native
@pytest.mark.usefixtures("two_threads")  # the 130-block case spans the kernel's OpenMP split
@pytest.mark.parametrize("pdtype,lp,gdtype,n,beta1", CASES)
def test_cpu_kernel_equals_the_oracle(pdtype, lp, gdtype, n, beta1):
    chained_vs_oracle("cpu", pdtype, lp, gdtype, n, beta1)


def split_vs_whole(backend: str) -> None:
    """A range stepped whole equals its two parts stepped apart (blocks are independent)."""
    n = 6 * BLOCK + 50
    whole = _state(n, torch.float32, torch.bfloat16, seed=11)
    g = torch.randn(n, generator=torch.Generator().manual_seed(4))
    halves = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in whole.items()}
    _step(whole, g, 1, backend)
    cut = 2 * BLOCK
    for lo, hi in ((0, cut), (cut, n)):
        part = {k: (t[lo:hi] if k in ("param", "exp_avg", "exp_avg_sq", "param_lp") else t)
                for k, t in halves.items()}
        part["exp_avg_absmax"] = halves["exp_avg_absmax"][lo // BLOCK:-(-hi // BLOCK)]
        part["exp_avg_sq_absmax"] = halves["exp_avg_sq_absmax"][lo // BLOCK:-(-hi // BLOCK)]
        _step(part, g[lo:hi], 1, backend)
    _same(whole, halves)


@native
def test_blocks_are_independent_of_the_split():
    split_vs_whole("cpu")


def test_refusals_name_the_argument_and_modify_nothing(monkeypatch):
    st = _state(BLOCK, torch.float32, None, seed=1)
    before = {k: t.clone() for k, t in st.items() if isinstance(t, torch.Tensor)}
    g = torch.randn(BLOCK)
    for bad in (4, 1, True):
        with pytest.raises(ValueError, match="format_version"):
            fused_adamw_compressed_(st["param"], g, st["exp_avg"], st["exp_avg_sq"], lr=1e-3,
                                    beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                                    exp_avg_absmax=st["exp_avg_absmax"],
                                    exp_avg_sq_absmax=st["exp_avg_sq_absmax"],
                                    format_version=bad)
    assert set(opmod.V3_BACKENDS) == {"cpu", "torch", "triton", "cuda"}
    # A backend without a version-3 kernel (none today) is refused before anything runs, by
    # the public op and by the custom op its callers may reach directly.
    monkeypatch.setattr(opmod, "V3_BACKENDS", ("cpu", "torch"))
    monkeypatch.setattr(opmod, "resolve_backend", lambda b, d: "triton")
    with pytest.raises(ValueError, match="format_version=3.*not 'triton'"):
        _step(st, g, 1, "triton")
    with pytest.raises(ValueError, match="format_version=3.*not 'triton'"):
        opmod._run("triton", st["param"], g, st["exp_avg"], st["exp_avg_sq"],
                   st["exp_avg_absmax"], st["exp_avg_sq_absmax"], None, None, 0, 1,
                   None, format_version=3)
    for k, t in before.items():
        assert torch.equal(st[k], t), f"{k} was modified"


def test_update_folds_the_bias_correction_of_v():
    """Version 3's update is AdamW's with ``v``'s bias correction folded into the step size
    and eps (``p - (step_size * bc2_sqrt) * m / (sqrt(v) + eps * bc2_sqrt)``): the oracle
    equals that formula spelled here with the contract's fp32 arithmetic and scalars folded
    in double, bit for bit; the unfolded arithmetic differs in the last bits, and both are
    AdamW's update to a few ulps in float64."""
    n = 3 * BLOCK
    st = _state(n, torch.float32, None, seed=5)
    p0 = st["param"].clone()
    m = dequantize_blockwise(st["exp_avg"], st["exp_avg_absmax"], code_map_v3(True))
    v = dequantize_blockwise(st["exp_avg_sq"], st["exp_avg_sq_absmax"], code_map_v3(False))
    g = torch.randn(n, generator=torch.Generator().manual_seed(6)) * 0.1
    hp = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, wd=0.1, step=3)  # _step's hyperparameters
    outs = folded_update_steps(p0, g, m, v, **hp)
    _step(st, g, hp["step"], "torch")
    p, mm, _ = outs["folded"]
    assert torch.equal(st["param"], p)
    codes, _ = quantize_blockwise_v3(mm, True)  # the moments do not depend on the fold
    assert torch.equal(st["exp_avg"], codes)


@native
def test_kernels_refuse_unfolded_scalars():
    """The version-3 kernels skip the division by ``bc2_sqrt``, exact only when it is 1: a
    caller passing the plain scalars is refused before anything is written."""
    st = _state(2 * BLOCK, torch.float32, None, seed=2)
    before = {k: t.clone() for k, t in st.items() if isinstance(t, torch.Tensor)}
    s = adam_scalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=2)
    args = (st["param"], torch.ones(2 * BLOCK), st["exp_avg"], st["exp_avg_sq"],
            st["exp_avg_absmax"], st["exp_avg_sq_absmax"], None, None, 0, 2,
            kernel_tables(st["param"].device))
    with pytest.raises(ValueError, match="folded scalars"):
        _native.require("cpu").adamw_compressed(*args, 3, *s)
    from zerokern.kernels.triton.adamw_compressed import adamw_compressed_triton_

    with pytest.raises(ValueError, match="folded scalars"):
        adamw_compressed_triton_(*args, s, format_version=3)
    for k, t in before.items():
        assert torch.equal(st[k], t), f"{k} was modified"


# ----------------------------------------------------------------------------------------
# The Triton kernel, under the interpreter (script side: run by triton_common)
# ----------------------------------------------------------------------------------------


_kv3 = None  # zerokern.kernels.triton.fmt_v3, once _triton_codes imported it


def _triton_codes() -> None:
    """The kernel's encoder and decoder (``kernels.triton.fmt_v3``) on every map
    value, midpoint and their fp32 neighbours (the probe values) under scales 1 (n = x),
    random, subnormal, huge, zero, inf and NaN, against codes_v3 of the oracle's
    normalisation and code_map_v3[c] * scale."""
    import triton
    import triton.language as tl

    from zerokern.kernels.triton import fmt_v3 as kv3
    from zerokern.quant.blockwise import normalise

    global _kv3  # the jit function below finds the kernel's helpers as a module global
    _kv3 = kv3

    @triton.jit
    def probe(x_ptr, s_ptr, cm_ptr, cv_ptr, ym_ptr, yv_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i)
        s = tl.load(s_ptr + i)
        cm = _kv3.quantize_v3(x, s, True)
        cv = _kv3.quantize_v3(x, s, False)
        tl.store(cm_ptr + i, cm)
        tl.store(cv_ptr + i, cv)
        tl.store(ym_ptr + i, _kv3.dequantize_v3(cm, s, True))
        tl.store(yv_ptr + i, _kv3.dequantize_v3(cv, s, False))

    x = _probe_values()
    n = 1 << (2 * x.numel() - 1).bit_length()
    x = x.repeat(-(-n // x.numel()))[:n].contiguous()
    gen = torch.Generator().manual_seed(9)
    i = torch.arange(n)
    s = torch.where(i < x.numel() // 2, 1.0, torch.rand(n, generator=gen) * 4)
    for k, special in enumerate((2.0**-140, 2.0**127, 0.0, float("inf"), float("nan"))):
        s[i % 97 == k] = special
    s = s.contiguous()
    cm, cv = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    ym, yv = torch.empty(n), torch.empty(n)
    probe[(1,)](x, s, cm, cv, ym, yv, N=n)
    nn = normalise(x, s)
    for signed, c, y in ((True, cm, ym), (False, cv, yv)):
        want = codes_v3(nn, signed).to(torch.uint8)
        bad = torch.nonzero(c != want).flatten()[:3].tolist()
        assert not bad, f"signed={signed}: codes differ at x={x[bad].tolist()} " \
                        f"s={s[bad].tolist()}: {c[bad].tolist()} vs {want[bad].tolist()}"
        dec = code_map_v3(signed)[want.long()] * s
        _same({"y": y}, {"y": dec})


def _interp_v3(out: dict) -> None:
    from zerokern.kernels.triton import adamw_compressed as kc

    assert kc._INTERPRETED, "TRITON_INTERPRET=1 was not in effect"
    grp = Group()
    grp.check("codes", _triton_codes)
    for case in CASES:
        if case[3] < 2**15:  # (the longest case is the CPU kernel's OpenMP split)
            grp.check(f"chained {case}", chained_vs_oracle, "triton", *case)
    grp.check("split", split_vs_whole, "triton")
    out["v3"] = grp.result()


CHECKS = {"interp": (("v3", _interp_v3),)}


@pytest.fixture(scope="module")
def interp():
    return triton_common.results("interp", __file__)


def test_triton_kernel_equals_the_oracle(interp):
    """The Triton kernel under the interpreter: its codes, the chained CASES, the split."""
    assert_group(interp, "v3", len(CASES) + 1)
