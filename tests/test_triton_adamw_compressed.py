"""The compressed-state AdamW Triton kernel (zerokern/kernels/triton/adamw_compressed.py) under
the Triton interpreter, without a GPU, bit for bit against the range contract's oracle
``adamw_compressed_torch_`` (zerokern/ops/adamw_compressed.py, pure PyTorch; its own tests
hold it to float64, to the quantization and rounding oracles and to torch's AdamW).

* Every combination of moments (fp32 / bf16 / uint8 codes) x parameter (fp32 master, with a
  bf16 or fp16 copy or none, or a bf16 parameter with stochastic rounding) x grad dtype x lerp
  branch x n in {1, 255, 257, 4109}, one step each, from random codes / scales / moments.
* Adversarial states, two chained steps each: all zeros (absmax 0), subnormals, huge values
  (inf in v), params at bf16's largest finite value pushed past it (saturation of the
  stochastic rounding, inf in the 16-bit copies), one outlier block, NaN and inf gradients at
  block edges (a NaN block absmax, decoded by the next step).
* Exact ties of the code search (new moments exactly on the decision thresholds, both signs,
  and one fp32 step either side), with the tie rule also checked directly.
* The stochastic rounding key: seeds 0 .. 2**64 - 1, steps crossing 2**31 and up to
  2**32 - 1, per-block indices above 2**31.
* The public op ``fused_adamw_compressed_(backend="triton")`` against ``backend="torch"``
  (routing, the int64 round trip of seeds >= 2**63); bad seed, step or tables refused with
  nothing modified.

Every tensor is followed by guard elements that must stay untouched (the masking of the last,
partial tile). The many-case groups launch 16 blocks per program (fewer programs for the slow
interpreter: a full tile and a partial one at n = 4109); the adversarial, tie and public-op
groups run the production tile of 4 blocks (n = 700: one partial tile; 1024: one full tile;
1283: a full tile and a partial one). Values compare by bit pattern; NaNs by position only
(their payload is not part of the contract: CPU and GPU arithmetic produce different NaN
bits), except the stochastically rounded bf16 parameter, whose NaN is 0x7FC0 by rule and
compares by bits too. The checks run in a subprocess with TRITON_INTERPRET=1 (see
triton_common.py); the codegen for sm_90 is checked in test_triton_compile.py.
"""

from __future__ import annotations

import pytest
import triton_common
from triton_common import Group, assert_group
from triton_common import bits as _bits
from triton_common import start_scripts as start_scripts  # conftest starts the subprocess

# ----------------------------------------------------------------------------------------
# Script side: run under the interpreter by triton_common
# ----------------------------------------------------------------------------------------

QB = 256  # elements per quantization block
GUARD = 7  # guard elements after every tensor
MOMENTS = ("fp32", "bf16", "int8")
PARAMS = ("fp32", "fp32+bf16", "fp32+fp16", "bf16-sr")
# Blocks per program for the many-case groups: 4109 elements in 2 programs (a full tile and a
# partial one) instead of 5; the other groups run the production tile (kc.ROWS).
ROWS_WIDE = 16
SEEDS = (0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63 + 12345, 2**64 - 1)


def _values(kind, n, gen, scale):
    """fp32 values of one tensor for an input kind (see the module docstring)."""
    import torch

    x = torch.randn(n, generator=gen) * scale
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "denormal":
        return torch.randn(n, generator=gen) * 1e-40  # fp32 subnormals (below 1.18e-38)
    if kind == "huge":
        x = torch.randn(n, generator=gen) * 1e30
        x[::5] = 3.3e38 * torch.sign(x[::5])
    if kind == "outlier":
        x[3::QB] *= 1e6  # one outlier in every block
        x[QB:2 * QB] *= 1e-6  # and one block of tiny values next to it
    return x


def _grads(kind, n, gen, gdtype, scale):

    g = _values("normal" if kind in ("nan", "saturate") else kind, n, gen, scale)
    if kind == "nan":
        for i in (0, QB - 1, QB, n - 1):  # block edges and the last (partial block) element
            if i < n:
                g[i] = float("nan")
        if n > 5:
            g[5] = float("inf")
            g[-3] = -float("inf")
    return g.to(gdtype)


def _alloc(values, guard_value):
    """values followed by GUARD elements of guard_value, in one buffer: (view, buffer)."""
    import torch

    buf = torch.cat([values.reshape(-1), torch.full((GUARD,), guard_value, dtype=values.dtype)])
    return buf[: values.numel()], buf


def _state(n, moments, pmode, kind, gen):
    """A fresh state: dict name -> (view, guarded buffer); None for unused tensors."""
    import torch

    from zerokern.quant.maps import SIGNED_MAP_ID, UNSIGNED_MAP_ID, code_map, quantize_blockwise

    nb = -(-n // QB)
    p = _values(kind, n, gen, 1.0)
    if kind == "saturate":  # params at and near bf16's largest finite value (0x7F7F)
        p = torch.finfo(torch.bfloat16).max * torch.sign(p)
        p[1::2] *= 0.999
        kind = "normal"
    m = _values(kind, n, gen, 0.1)
    v = _values(kind, n, gen, 0.01).abs()
    st = {}
    if pmode == "bf16-sr":
        st["param"] = _alloc(p.bfloat16(), 5.0)
    else:
        st["param"] = _alloc(p, 5.0)
    lp = {"fp32+bf16": torch.bfloat16, "fp32+fp16": torch.float16}.get(pmode)
    st["param_lp"] = None if lp is None else _alloc(torch.full((n,), 7.0, dtype=lp), 7.0)
    st["exp_avg_absmax"] = st["exp_avg_sq_absmax"] = None
    if moments == "int8":
        if kind == "normal":  # every code, random block scales (one all-zero block)
            cm = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
            cv = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
            am, av = torch.rand(nb, generator=gen) * 0.3, torch.rand(nb, generator=gen) * 0.01
            am[nb // 2] = 0.0
        else:  # the codes these values quantize to
            cm, am = quantize_blockwise(m, code_map(SIGNED_MAP_ID))
            cv, av = quantize_blockwise(v, code_map(UNSIGNED_MAP_ID))
        st["exp_avg"], st["exp_avg_sq"] = _alloc(cm, 77), _alloc(cv, 77)
        st["exp_avg_absmax"], st["exp_avg_sq_absmax"] = _alloc(am, 9.0), _alloc(av, 9.0)
    else:
        dt = torch.float32 if moments == "fp32" else torch.bfloat16
        st["exp_avg"], st["exp_avg_sq"] = _alloc(m.to(dt), 3.0), _alloc(v.to(dt), 3.0)
    return st


def _clone(st):
    out = {}
    for k, t in st.items():
        if t is None:
            out[k] = None
        else:
            buf = t[1].clone()
            out[k] = (buf[: t[0].numel()], buf)
    return out


def _same_tensor(what, got, want, nan_by_position):
    """Bit patterns equal (NaNs by position when nan_by_position)."""
    import torch

    if got.dtype.is_floating_point and nan_by_position:
        gn, wn = torch.isnan(got), torch.isnan(want)
        bad = torch.nonzero(gn != wn).flatten()
        assert bad.numel() == 0, f"{what}: NaN positions differ at {bad[:5].tolist()}"
        diff = (_bits(got) != _bits(want)) & ~gn
    else:
        diff = _bits(got) != _bits(want)
    bad = torch.nonzero(diff).flatten()[:5].tolist()
    assert not bad, (f"{what}: {int(diff.sum())} elements differ, first at {bad}: triton "
                     f"{got[bad].tolist()} torch {want[bad].tolist()}")


def _same_state(got, want, sr):
    for k in got:
        if got[k] is not None:
            # The whole guarded buffer: the range and the untouched guard elements after it.
            _same_tensor(k, got[k][1], want[k][1], nan_by_position=not (sr and k == "param"))


def _run_pair(st_triton, st_torch, grad, sr_index, seed, steps, hp, rows=None):
    """The same chained steps with the kernel and with the oracle; compare after each.
    rows: the kernel's blocks per program (None: the production tile)."""
    import torch

    from zerokern.kernel_contract import adam_scalars, fold_bias_correction
    from zerokern.kernels.triton.adamw_compressed import adamw_compressed_triton_
    from zerokern.ops.adamw_compressed import adamw_compressed_torch_
    from zerokern.quant.maps import kernel_tables

    names = ("param", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax",
             "param_lp")
    sr = sr_index is not None
    g0 = grad.clone()
    folded = st_torch["exp_avg"][0].dtype == torch.bfloat16  # bf16 moments fold (the op does)
    for step in steps:
        s = adam_scalars(step=step, **hp)
        s = fold_bias_correction(s) if folded else s
        a = [None if st_triton[k] is None else st_triton[k][0] for k in names]
        b = [None if st_torch[k] is None else st_torch[k][0] for k in names]
        kw = {} if rows is None else {"rows": rows}
        adamw_compressed_triton_(a[0], grad, *a[1:], sr_index, seed, step, kernel_tables("cpu"),
                                 s, **kw)
        adamw_compressed_torch_(b[0], grad, *b[1:], sr_index, seed, step, s)
        _same_state(st_triton, st_torch, sr)
    assert _bits(grad).equal(_bits(g0)), "grad modified"


def _sr_index(nb, gen, where):
    """Each block's first index in its parameter: consecutive blocks from a base, or (where
    == "scattered") unrelated blocks of one large parameter, all below 2**32."""
    import torch

    if where == "scattered":
        return torch.randint(0, 2**24, (nb,), generator=gen) * QB
    base = {"low": 0, "mid": 2**31 - 3 * QB, "top": 2**32 - QB * nb}[where]
    return base + QB * torch.arange(nb, dtype=torch.int64)


def _hp(lerp_low, scaled):
    return dict(lr=1e-3, beta1=0.9 if lerp_low else 0.3, beta2=0.999, eps=1e-8,
                weight_decay=0.1, grad_scale=1024.0 if scaled else 1.0)


def _interp_combinations(out):
    import torch

    from zerokern.kernels.triton import adamw_compressed as kc

    assert kc._INTERPRETED, "TRITON_INTERPRET=1 was not in effect"
    grp = Group()
    gdtypes = (torch.float32, torch.bfloat16, torch.float16)
    i = 0
    for n in (1, 255, 257, 4109):
        for moments in MOMENTS:
            for pmode in PARAMS:
                for gdtype in gdtypes:
                    for lerp_low in (True, False):
                        i += 1
                        gen = torch.Generator().manual_seed(i)
                        scaled = i % 2 == 0
                        name = (f"n={n} moments={moments} param={pmode} grad={gdtype} "
                                f"lerp_low={lerp_low} scaled={scaled}")
                        st = _state(n, moments, pmode, "normal", gen)
                        grad = _grads("normal", n, gen, gdtype, 1024.0 if scaled else 1.0)
                        sr = pmode == "bf16-sr"
                        nb = -(-n // QB)
                        sr_index = _sr_index(nb, gen, ("low", "mid", "top")[i % 3]) if sr else None
                        seed = SEEDS[i % len(SEEDS)]
                        first = (1, 2**31 - 1, 2**32 - 2, 7)[i % 4]
                        grp.check(name, _run_pair, st, _clone(st), grad, sr_index, seed,
                                  (first,), _hp(lerp_low, scaled), ROWS_WIDE)
    out["combinations"] = grp.result()


def _interp_adversarial(out):
    import torch

    grp = Group()
    gdtypes = (torch.float32, torch.bfloat16, torch.float16)
    i = 0
    for kind in ("zeros", "denormal", "huge", "saturate", "outlier", "nan"):
        for moments in MOMENTS:
            for pmode in PARAMS:
                i += 1
                gdtype = gdtypes[i % 3]
                n = 700
                gen = torch.Generator().manual_seed(1000 + i)
                st = _state(n, moments, pmode, kind, gen)
                grad = _grads(kind, n, gen, gdtype, 1.0)
                hp = _hp(i % 2 == 0, False)
                if kind == "saturate":
                    # Steps of about 1e35 on params at bf16's largest finite value: fp32
                    # results in the 1.3e36 wide window above it (the stochastic rounding
                    # saturates, the 16-bit copies round to inf). No decay: lr * weight_decay
                    # would overflow p * decay.
                    hp.update(lr=1e34, weight_decay=0.0)
                sr = pmode == "bf16-sr"
                sr_index = _sr_index(-(-n // QB), gen, "scattered") if sr else None
                name = f"{kind} n={n} moments={moments} param={pmode} grad={gdtype}"
                grp.check(name, _run_pair, st, _clone(st), grad, sr_index, SEEDS[i % 7],
                          (1, 2), hp)
    # One lerp decision on the fp32-rounded w, as the oracle makes it: 1 - beta1 just below
    # 0.5, where the fp32 w rounds to 0.5 (the other branch than the unrounded value's).
    for moments in MOMENTS:
        gen = torch.Generator().manual_seed(7)
        st = _state(1283, moments, "fp32", "normal", gen)
        grad = _grads("normal", 1283, gen, torch.float32, 1.0)
        hp = dict(_hp(True, False), beta1=0.5 + 2**-30)
        grp.check(f"beta1=0.5+2**-30 moments={moments}", _run_pair, st, _clone(st), grad, None,
                  0, (1, 2), hp)
    out["adversarial"] = grp.result()


def _interp_ties(out):
    """Exact ties of the code search: new exp_avg values exactly on the signed map's decision
    thresholds. With exp_avg = 0, beta1 = 0.5 (the lerp's other branch) the new exp_avg is
    fma(-g, 0.5, g) = g / 2 exactly, so g = 2 * t_k next to a g = 2 (absmax 1) puts q on
    t_k. The rule (ties toward zero: t_k itself gets code k when t_k >= 0, k + 1 when
    t_k < 0) is checked directly, and the kernel against the oracle, with the values one
    fp32 step either side of each threshold in the next blocks."""
    import torch

    from zerokern.quant.maps import SIGNED_MAP_ID, UNSIGNED_MAP_ID, code_map, decision_thresholds

    grp = Group()
    signed = code_map(SIGNED_MAP_ID)
    t = decision_thresholds(signed)  # 255 values
    up = torch.nextafter(t, torch.full_like(t, 2.0))
    down = torch.nextafter(t, torch.full_like(t, -2.0))
    two = torch.tensor([2.0])
    g = torch.cat([two, 2 * t, two, 2 * up, two, 2 * down, two, -2 * t])  # 4 blocks of 256
    n = g.numel()
    zero_code = int(torch.nonzero(signed == 0).item())
    st = {
        "param": _alloc(torch.ones(n), 5.0),
        "param_lp": None,
        "exp_avg": _alloc(torch.full((n,), zero_code, dtype=torch.uint8), 77),
        "exp_avg_sq": _alloc(torch.zeros(n, dtype=torch.uint8), 77),
        "exp_avg_absmax": _alloc(torch.ones(n // QB), 9.0),
        "exp_avg_sq_absmax": _alloc(torch.ones(n // QB), 9.0),
    }
    assert float(code_map(UNSIGNED_MAP_ID)[0]) == 0.0
    hp = dict(lr=1e-3, beta1=0.5, beta2=0.75, eps=1e-8, weight_decay=0.0, grad_scale=1.0)
    ref = _clone(st)
    grp.check("thresholds and neighbours", _run_pair, st, ref, g, None, 0, (1,), hp)

    def rule():
        codes = ref["exp_avg"][0][1:QB].long()
        want = torch.arange(255) + (t < 0).long()
        bad = torch.nonzero(codes != want).flatten()[:5].tolist()
        assert not bad, f"tie codes at thresholds {bad}: {codes[bad].tolist()} vs {want[bad]}"
        assert float(ref["exp_avg_absmax"][0][0]) == 1.0

    grp.check("ties toward zero", rule)
    out["ties"] = grp.result()


def _interp_sr_keys(out):
    """The stochastic rounding key: every edge seed with steps around 2**31 and 2**32 - 1,
    indices near 2**31 and 2**32 (one 4109-element range, fp32 moments)."""
    import torch

    grp = Group()
    for j, seed in enumerate(SEEDS):
        for step in (2**31 - 1, 2**32 - 1):
            gen = torch.Generator().manual_seed(j)
            n = 4109
            st = _state(n, "fp32", "bf16-sr", "normal", gen)
            grad = _grads("normal", n, gen, torch.bfloat16, 1.0)
            sr_index = _sr_index(-(-n // QB), gen, ("mid", "top")[j % 2])
            grp.check(f"seed={seed} step={step}", _run_pair, st, _clone(st), grad, sr_index,
                      seed, (step,), _hp(True, False), ROWS_WIDE)
    out["sr_keys"] = grp.result()


def _interp_public_op(out):
    """fused_adamw_compressed_ routes backend="triton" to the kernel (CPU tensors under the
    interpreter) and equals backend="torch"; bad seed/step/tables are refused untouched."""
    import torch

    from zerokern.kernel_contract import adam_scalars
    from zerokern.kernels.triton.adamw_compressed import adamw_compressed_triton_
    from zerokern.ops.adamw_compressed import fused_adamw_compressed_
    from zerokern.quant.maps import kernel_tables

    grp = Group()
    for moments in MOMENTS:
        for pmode in ("fp32+bf16", "bf16-sr"):
            gen = torch.Generator().manual_seed(3)
            n = 1283
            st = {"triton": _state(n, moments, pmode, "normal", gen)}
            st["torch"] = _clone(st["triton"])
            grad = _grads("normal", n, gen, torch.bfloat16, 1.0)
            sr = pmode == "bf16-sr"
            sr_index = _sr_index(-(-n // QB), gen, "mid") if sr else None

            def run(st=st, grad=grad, sr_index=sr_index, sr=sr):
                for backend in ("triton", "torch"):
                    t = {k: None if v is None else v[0] for k, v in st[backend].items()}
                    fused_adamw_compressed_(
                        t["param"], grad, t["exp_avg"], t["exp_avg_sq"], lr=1e-3, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.1, step=5,
                        exp_avg_absmax=t["exp_avg_absmax"],
                        exp_avg_sq_absmax=t["exp_avg_sq_absmax"], param_lp=t["param_lp"],
                        sr_index=sr_index, seed=2**64 - 3 if sr else None, backend=backend)
                _same_state(st["triton"], st["torch"], sr)

            grp.check(f"op moments={moments} param={pmode}", run)

    def refused():
        n = 300
        p = torch.randn(n).bfloat16()
        m, v, g = torch.zeros(n), torch.zeros(n), torch.ones(n)
        idx = torch.zeros(2, dtype=torch.int64)
        s = adam_scalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
        before = [t.clone() for t in (p, m, v)]
        tables = kernel_tables("cpu")
        bad = [
            (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"), (dict(seed=1.0), "seed"),
            (dict(step=0), "step"), (dict(step=2**32), "step"), (dict(step=True), "step"),
            (dict(tables=tables[:512]), "tables"), (dict(tables=tables.double()), "tables"),
        ]
        for change, word in bad:
            kw = {**dict(seed=1, step=1, tables=tables), **change}
            try:
                adamw_compressed_triton_(p, g, m, v, None, None, None, idx, kw["seed"],
                                         kw["step"], kw["tables"], s)
            except ValueError as e:
                assert word in str(e), (change, str(e))
            else:
                raise AssertionError(f"{change} was accepted")
            for t, t0 in zip((p, m, v), before):
                assert _bits(t).equal(_bits(t0)), f"{change}: modified a tensor"

    grp.check("refusals", refused)
    out["public_op"] = grp.result()


def _interp_words(out):
    """The kernel's seed and step arguments are int32 bit patterns whatever their values, so
    Triton types them i32 always (one compiled kernel), and the words reassemble exactly."""
    from zerokern.kernel_contract import adam_scalars
    from zerokern.kernels.triton.adamw_compressed import compressed_scalars

    grp = Group()
    s = adam_scalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)

    def check(seed, step):
        k = compressed_scalars(s, seed, step)
        words = [k["seed_lo_bits"], k["seed_hi_bits"], k["step_bits"]]
        assert all(-(2**31) <= w < 2**31 for w in words), words
        lo, hi, st = (w % 2**32 for w in words)
        assert (hi << 32 | lo, st) == (seed, step), (lo, hi, st)

    for seed in (0, 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1):
        for step in (1, 2**31 - 1, 2**31, 2**32 - 1):
            grp.check(f"seed={seed} step={step}", check, seed, step)
    out["words"] = grp.result()


CHECKS = {"interp": (("combinations", _interp_combinations),
                     ("adversarial", _interp_adversarial),
                     ("ties", _interp_ties),
                     ("sr_keys", _interp_sr_keys),
                     ("public_op", _interp_public_op),
                     ("words", _interp_words))}


# ----------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interp():
    return triton_common.results("interp", __file__)


def test_every_combination_bitwise_vs_oracle(interp):
    # 4 sizes x 3 moment formats x 4 parameter modes x 3 grad dtypes x 2 lerp branches
    assert_group(interp, "combinations", 288)


def test_adversarial_states_bitwise_vs_oracle(interp):
    assert_group(interp, "adversarial", 6 * 3 * 4 + 3)


def test_code_search_ties_bitwise_vs_oracle(interp):
    assert_group(interp, "ties", 2)


def test_stochastic_rounding_keys_bitwise_vs_oracle(interp):
    assert_group(interp, "sr_keys", 14)


def test_public_op_routes_to_kernel_and_refuses_bad_input(interp):
    assert_group(interp, "public_op", 7)


def test_seed_and_step_travel_as_int32_words(interp):
    assert_group(interp, "words", 28)
