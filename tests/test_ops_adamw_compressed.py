"""The fused CPU kernel of the compressed AdamW step (csrc/adam_compressed_cpu.cpp) against
its oracle, ``backend="torch"`` of ``fused_adamw_compressed_`` (pure PyTorch, independent of
the kernel): bit for bit in every output, NaN payloads aside (where NaN appears, both must
have NaN at the same positions).

Covered: every moment format (fp32, bf16, uint8 codes) x param mode (fp32 master with no
copy, a bf16 or fp16 copy; bf16 param with stochastic rounding) x grad dtype x both lerp
branches; sizes that exercise the 16-lane, 8-lane and scalar tails and the OpenMP split;
adversarial values; chained steps; the argument checks of the binding; and that the default
backend on CPU is this kernel.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from zerokern import _native
from zerokern.ops.adamw_compressed import fused_adamw_compressed_
from zerokern.quant.blockwise import quantize_blockwise_v2
from zerokern.quant.maps import (
    BLOCK,
    SIGNED_MAP_ID,
    UNSIGNED_MAP_ID,
    code_map,
    decision_thresholds,
    kernel_tables,
    quantize_blockwise,
)

pytestmark = [
    pytest.mark.skipif(
        not (_native.has_native() and hasattr(_native._C, "adamw_compressed")),
        reason="zerokern._C without the cpu adamw_compressed kernel",
    ),
    # test_parallel_path runs the kernel's OpenMP split: on two threads, as the split is what
    # it tests (conftest.py runs the other in-process tests on one).
    pytest.mark.usefixtures("two_threads"),
]

MOMENTS = ("fp32", "bf16", "int8")
# (param dtype, param_lp dtype)
PARAMS = ((torch.float32, None), (torch.float32, torch.bfloat16),
          (torch.float32, torch.float16), (torch.bfloat16, None))
GRADS = (torch.float32, torch.bfloat16, torch.float16)
HP = dict(lr=1e-2, beta2=0.999, eps=1e-8, weight_decay=0.1)
SEED = 2**63 + 12345  # above 2**63: the key's high word has its top bit set

_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality; float NaNs must sit at the same positions (payloads may differ)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if not got.dtype.is_floating_point:
        bad = (got != want).nonzero().flatten()
        assert bad.numel() == 0, f"{what}: {bad.numel()} differ, first at {bad[:5].tolist()}"
        return
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{what}: NaN positions differ"
    gb, wb = got.view(_INT[got.dtype])[~gn], want.view(_INT[want.dtype])[~wn]
    bad = (gb != wb).nonzero().flatten()
    assert bad.numel() == 0, (f"{what}: {bad.numel()} differ, e.g. {got[~gn][bad[:3]].tolist()}"
                              f" vs {want[~wn][bad[:3]].tolist()}")


class State:
    """One range's tensors in the layout fused_adamw_compressed_ takes."""

    def __init__(self, param, exp_avg, exp_avg_sq, absmax_m=None, absmax_v=None,
                 param_lp=None, sr_index=None):
        self.param, self.exp_avg, self.exp_avg_sq = param, exp_avg, exp_avg_sq
        self.absmax_m, self.absmax_v = absmax_m, absmax_v
        self.param_lp, self.sr_index = param_lp, sr_index

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {"param": self.param, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                "exp_avg_absmax": self.absmax_m, "exp_avg_sq_absmax": self.absmax_v,
                "param_lp": self.param_lp}

    def clone(self) -> State:
        c = {k: (None if t is None else t.clone()) for k, t in self.tensors().items()}
        return State(c["param"], c["exp_avg"], c["exp_avg_sq"], c["exp_avg_absmax"],
                     c["exp_avg_sq_absmax"], c["param_lp"], self.sr_index)

    def step(self, grad: torch.Tensor, step: int, backend: str, **hp) -> None:
        kw = {**HP, "beta1": 0.9, **hp}
        fused_adamw_compressed_(
            self.param, grad, self.exp_avg, self.exp_avg_sq, step=step,
            exp_avg_absmax=self.absmax_m, exp_avg_sq_absmax=self.absmax_v,
            param_lp=self.param_lp, sr_index=self.sr_index,
            seed=SEED if self.sr_index is not None else None, backend=backend, **kw)


def make_state(n: int, moments: str, pdtype: torch.dtype, lp: torch.dtype | None,
               m: torch.Tensor, v: torch.Tensor, p: torch.Tensor) -> State:
    """A state holding fp32 values m, v, p in the requested formats."""
    nb = -(-n // BLOCK)
    absmax_m = absmax_v = None
    if moments == "int8":
        exp_avg, absmax_m = quantize_blockwise(m, code_map(SIGNED_MAP_ID))
        exp_avg_sq, absmax_v = quantize_blockwise(v, code_map(UNSIGNED_MAP_ID))
    else:
        dt = torch.float32 if moments == "fp32" else torch.bfloat16
        exp_avg, exp_avg_sq = m.to(dt), v.to(dt)
    param_lp = None if lp is None else torch.full((n,), 7.0, dtype=lp)
    # Blocks of a bf16 param start at arbitrary indices of their parameter.
    sr_index = (torch.arange(nb, dtype=torch.int64) * 3 * BLOCK + 5
                if pdtype == torch.bfloat16 else None)
    return State(p.to(pdtype), exp_avg, exp_avg_sq, absmax_m, absmax_v, param_lp, sr_index)


def random_state(n: int, moments: str, pdtype: torch.dtype, lp: torch.dtype | None,
                 seed: int) -> State:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    return make_state(n, moments, pdtype, lp, m, v, p)


def random_grad(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # magnitudes over several decades, so blocks have outliers and tiny values
    g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2)
    return g.to(dtype)


def run_both(state: State, grads: list[torch.Tensor], first_step: int = 1, **hp) -> None:
    """Step the kernel and the oracle from the same state with the same grads; compare."""
    ref, got = state.clone(), state.clone()
    for k, g in enumerate(grads):
        ref.step(g, first_step + k, "torch", **hp)
        got.step(g, first_step + k, "cpu", **hp)
        for name, t in got.tensors().items():
            if t is not None:
                _assert_same(t, ref.tensors()[name], f"step {first_step + k} {name}")


@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("pdtype,lp", PARAMS)
@pytest.mark.parametrize("gdtype", GRADS)
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # both branches of the lerp
def test_every_combination_bitwise(moments, pdtype, lp, gdtype, beta1):
    # 4 blocks and a partial one of 13: 64-element chunks (full blocks), 16-lane chunks, one
    # 8-lane chunk and 5 scalar elements.
    n = 4 * BLOCK + 13
    state = random_state(n, moments, pdtype, lp, seed=n)
    run_both(state, [random_grad(n, gdtype, seed=s) for s in (1, 2)], beta1=beta1,
             grad_scale=3.0)


@pytest.mark.parametrize("n", [1, 15, 255, 256, 257, 2 * BLOCK + 72])
@pytest.mark.parametrize("moments,pdtype,lp", [("int8", torch.float32, torch.bfloat16),
                                               ("int8", torch.bfloat16, None),
                                               ("bf16", torch.float32, torch.float16)])
def test_sizes(n, moments, pdtype, lp):
    state = random_state(n, moments, pdtype, lp, seed=7)
    run_both(state, [random_grad(n, torch.bfloat16, seed=3)])


@pytest.mark.parametrize("moments,pdtype,lp", [("int8", torch.float32, torch.bfloat16),
                                               ("int8", torch.bfloat16, None)])
def test_parallel_path(moments, pdtype, lp):
    n = 2**17 + 5  # above the threshold where OpenMP splits the range (on block boundaries)
    state = random_state(n, moments, pdtype, lp, seed=11)
    run_both(state, [random_grad(n, torch.bfloat16, seed=4)], first_step=1000)


@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16])
def test_chained_steps(pdtype):
    n = 8 * BLOCK + 100
    lp = torch.bfloat16 if pdtype == torch.float32 else None
    state = random_state(n, "int8", pdtype, lp, seed=5)
    run_both(state, [random_grad(n, torch.float32, seed=s) for s in range(6)])


def _adversarial(n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """m, v, p, grad with one kind of trouble per block."""
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    g = torch.randn(n, generator=gen)
    b = [slice(k * BLOCK, (k + 1) * BLOCK) for k in range(n // BLOCK)]
    tiny = torch.finfo(torch.float32).tiny
    m[b[0]] = 0.0  # an all-zero block, with zero grads: stays zero
    v[b[0]] = 0.0
    g[b[0]] = 0.0
    g[b[1]] = torch.randn(BLOCK, generator=gen) * tiny  # subnormal grads
    m[b[1]] = torch.randn(BLOCK, generator=gen) * tiny
    v[b[1]] = tiny * 0.5
    g[b[2]] = torch.randn(BLOCK, generator=gen) * 1e38  # near fp32 max (v overflows to inf)
    p[b[2]] = torch.randn(BLOCK, generator=gen) * 1e38
    g[b[3]] *= 1e-3  # one outlier per block
    g[b[3].start + 77] = 1e4
    m[b[3].start + 3] = -50.0
    g[b[4].start + 9] = float("nan")
    g[b[5].start + 200] = float("inf")
    g[b[6].start + 1] = float("-inf")
    g[b[7]] = -0.0  # negative zeros throughout
    m[b[7]] = -0.0
    p[b[8]] = torch.randn(BLOCK, generator=gen) * tiny  # subnormal params
    return m, v, p, g


@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("pdtype,lp", PARAMS)
def test_adversarial_values(moments, pdtype, lp):
    n = 9 * BLOCK + 3
    gen = torch.Generator().manual_seed(13)
    m, v, p, g = _adversarial(n, gen)
    state = make_state(n, moments, pdtype, lp, m, v, p)
    run_both(state, [g, torch.randn(n, generator=gen)], grad_scale=1.0)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_quantization_ties(sign):
    # beta1 = 0 makes the new exp_avg the grad itself, and a 1.0 per block makes its absmax
    # 1: n is then exactly each chosen value, which sits on, just below or just above a
    # threshold of the signed map (ties go toward zero). beta2 = 0 makes exp_avg_sq =
    # RN(g*g), which lands within an ulp or two of the unsigned map's thresholds.
    thr = decision_thresholds(code_map(SIGNED_MAP_ID))
    up = torch.nextafter(thr, torch.full_like(thr, 2.0))
    down = torch.nextafter(thr, torch.full_like(thr, -2.0))
    vals = torch.stack([thr, up, down], 1).reshape(-1) * sign
    vals = vals[vals.abs() <= 1.0]
    uthr = decision_thresholds(code_map(UNSIGNED_MAP_ID))
    roots = uthr.double().sqrt().float()
    roots = torch.cat([roots, torch.nextafter(roots, torch.ones_like(roots))])
    chosen = torch.cat([vals, roots])
    per = BLOCK - 1  # the last element of every block is the +-1 that sets its absmax
    nblocks = -(-chosen.numel() // per)
    g = torch.zeros(nblocks, BLOCK)
    body = torch.zeros(nblocks * per)
    body[: chosen.numel()] = chosen
    g[:, :per] = body.view(nblocks, per)
    g[:, per] = sign
    g = g.reshape(-1)
    n = g.numel()
    state = make_state(n, "int8", torch.float32, None, torch.zeros(n), torch.zeros(n),
                       torch.zeros(n))
    run_both(state, [g], beta1=0.0, beta2=0.0, weight_decay=0.0)


def _table(signed_map: torch.Tensor, unsigned_map: torch.Tensor) -> torch.Tensor:
    """kernel_tables' layout for other maps."""
    inf = torch.tensor([float("inf")])
    return torch.cat([signed_map, decision_thresholds(signed_map), inf,
                      unsigned_map, decision_thresholds(unsigned_map), inf])


@pytest.mark.parametrize("kind", ["linear", "clustered"])
def test_other_code_maps(kind):
    # The kernel takes its maps from `tables`: evenly spaced maps (the per-bucket lookup words
    # are derived for them too) and maps with thresholds closer than a bf16 ulp (no lookup
    # words: the exact search for every element). beta1 = 0 and beta2 = 0 make the new
    # moments g and RN(g * g), whose codes quantize_blockwise_v2 gives independently.
    signed = torch.linspace(-1, 1, 256)
    unsigned = torch.linspace(0, 1, 256)
    if kind == "clustered":
        signed[192:194] = signed[191] + torch.tensor([2.0**-20, 2.0**-19])
        unsigned[97:99] = unsigned[96] + torch.tensor([2.0**-21, 2.0**-20])
    n = 3 * BLOCK + 40
    gen = torch.Generator().manual_seed(21)
    g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))
    g[BLOCK:BLOCK + 200] = signed[150:250].repeat(2) * 2.0  # on the map, ties included
    nb = -(-n // BLOCK)
    m = torch.zeros(n, dtype=torch.uint8)
    v = torch.zeros(n, dtype=torch.uint8)
    absmax_m, absmax_v = torch.ones(nb), torch.ones(nb)
    _native._C.adamw_compressed(
        torch.zeros(n), g, m, v, absmax_m, absmax_v, None, None, 0, 1, _table(signed, unsigned),
        2, 1.0, 1.0, 0.0, 1.0, 1e-3, 1.0, 1e-8, 1.0)
    want_m, want_am = quantize_blockwise_v2(g, signed)
    want_v, want_av = quantize_blockwise_v2(g * g, unsigned)
    _assert_same(m, want_m, "exp_avg codes")
    _assert_same(absmax_m, want_am, "exp_avg_absmax")
    _assert_same(v, want_v, "exp_avg_sq codes")
    _assert_same(absmax_v, want_av, "exp_avg_sq_absmax")


def test_backend_none_on_cpu_is_the_native_kernel(monkeypatch):
    monkeypatch.delenv("ZEROKERN_BACKEND", raising=False)
    calls = []
    real = _native._C.adamw_compressed

    class Spy:
        def __getattr__(self, name):
            return getattr(_native._C, name)

        @staticmethod
        def adamw_compressed(*args):
            calls.append(len(args))
            return real(*args)

    monkeypatch.setattr(_native, "require", lambda backend: Spy())
    n = BLOCK + 1
    state = random_state(n, "int8", torch.float32, torch.bfloat16, seed=3)
    ref = state.clone()
    g = random_grad(n, torch.bfloat16, seed=1)
    state.step(g, 1, None)
    assert calls, "backend=None on CPU did not run the native kernel"
    ref.step(g, 1, "torch")
    for name, t in state.tensors().items():
        if t is not None:
            _assert_same(t, ref.tensors()[name], name)


def _binding_args(n: int = 300) -> dict:
    nb = -(-n // BLOCK)
    return dict(
        param=torch.randn(n), grad=torch.randn(n), exp_avg=torch.zeros(n, dtype=torch.uint8),
        exp_avg_sq=torch.zeros(n, dtype=torch.uint8), exp_avg_absmax=torch.ones(nb),
        exp_avg_sq_absmax=torch.ones(nb), param_lp=None, sr_index=None, seed=0, step=1,
        tables=kernel_tables("cpu"), format_version=2)


_SCALARS = dict(decay=1.0, one_minus_beta1=0.1, beta2=0.999, one_minus_beta2=0.001,
                step_size=1e-3, bc2_sqrt=0.03, eps=1e-8, inv_grad_scale=1.0)


@pytest.mark.parametrize("change,needle", [
    (dict(grad=torch.randn(299)), "grad"),
    (dict(exp_avg_sq=torch.zeros(300)), "exp_avg_sq"),
    (dict(exp_avg_absmax=None), "exp_avg_absmax"),
    (dict(exp_avg_sq_absmax=torch.ones(3)), "exp_avg_sq_absmax"),
    (dict(param=torch.randn(300, dtype=torch.float16)), "param"),
    (dict(param=torch.randn(300, dtype=torch.bfloat16)), "sr_index"),
    (dict(param_lp=torch.zeros(300)), "param_lp"),
    (dict(tables=torch.zeros(1000)), "tables"),
    (dict(sr_index=torch.zeros(2, dtype=torch.int64)), "sr_index"),
    (dict(format_version=4), "format_version"),
])
def test_binding_refuses_bad_arguments(change, needle):
    args = {**_binding_args(), **change}
    before = {k: t.clone() for k, t in args.items() if isinstance(t, torch.Tensor)}
    with pytest.raises((RuntimeError, TypeError, ValueError), match=needle):
        _native._C.adamw_compressed(*args.values(), *_SCALARS.values())
    for k, t in before.items():
        assert torch.equal(args[k], t), f"{k} was modified"


@pytest.mark.parametrize("kwargs,exc,needle", [
    (dict(seed=-1), ValueError, "seed"),
    (dict(sr_index=None), ValueError, "sr_index"),
    (dict(step=0), ValueError, "step"),
])
def test_op_refuses_bad_arguments_before_the_kernel(kwargs, exc, needle):
    n = BLOCK + 3
    state = random_state(n, "int8", torch.bfloat16, None, seed=1)
    before = state.clone()
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
              exp_avg_absmax=state.absmax_m, exp_avg_sq_absmax=state.absmax_v,
              sr_index=state.sr_index, seed=1, backend="cpu")
    kw.update(kwargs)
    with pytest.raises(exc, match=needle):
        fused_adamw_compressed_(state.param, torch.randn(n), state.exp_avg, state.exp_avg_sq,
                                **kw)
    for name, t in state.tensors().items():
        if t is not None:
            assert torch.equal(t, before.tensors()[name]), f"{name} was modified"


def test_seed_step_and_index_key_the_rounding():
    # The same key gives the same bits; another seed or sr_index (same step, so the same
    # fp32 update) gives other roundings: the kernel reads the whole key and nothing else.
    n = 2 * BLOCK
    base = random_state(n, "bf16", torch.bfloat16, None, seed=2)
    g = random_grad(n, torch.float32, seed=9)

    def rounded(seed: int, shift: int) -> torch.Tensor:
        s = base.clone()
        fused_adamw_compressed_(s.param, g, s.exp_avg, s.exp_avg_sq, lr=1e-2, beta1=0.9,
                                beta2=0.999, eps=1e-8, weight_decay=0.0, step=3,
                                sr_index=base.sr_index + shift, seed=seed, backend="cpu")
        return s.param.view(torch.int16).clone()

    outs = {key: rounded(*key) for key in itertools.product((1, 2**40 + 1), (0, BLOCK))}
    for key, out in outs.items():
        assert torch.equal(out, rounded(*key)), key
    for a, b in itertools.combinations(outs, 2):
        assert not torch.equal(outs[a], outs[b]), (a, b)
