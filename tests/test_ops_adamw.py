"""fused_adamw_ on every CPU backend against a float64 reference and torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch
from _tol import ADAM_FP32
from references import reference64

from zerokern import ops
from zerokern.ops._backend import available_backends

# The sizes above the kernels' thresholds run their OpenMP split: on two threads, as the
# split is what they test (conftest.py runs the other in-process tests on one).
pytestmark = pytest.mark.usefixtures("two_threads")
CPU_BACKENDS = [b for b in available_backends("cpu") if b != "triton"]
SIZES = [1, 7, 4099, 65539]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]




def make(n, gdtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 3).to(gdtype)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    return [t.to(device) for t in (p, g, m, v)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gdtype", GRAD_DTYPES)
@pytest.mark.parametrize("lp", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wd,step,grad_scale", [(0.0, 1, 1.0), (0.1, 1000, 1024.0), (0.1, 1, 8.0)])
def test_matches_float64(backend, n, gdtype, lp, wd, step, grad_scale):
    p, g, m, v = make(n, gdtype, seed=n)
    g = (g.float() * grad_scale).to(gdtype) if gdtype == torch.float32 else g
    hp = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=wd, step=step, grad_scale=grad_scale)
    rp, rm, rv = reference64(p, g, m, v, **hp)
    param_lp = None if lp is None else torch.empty(n, dtype=lp)
    ops.fused_adamw_(
        p,
        g,
        m,
        v,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=wd,
        step=step,
        grad_scale=grad_scale,
        param_lp=param_lp,
        backend=backend,
    )
    rtol, atol = ADAM_FP32
    torch.testing.assert_close(m.double(), rm, rtol=rtol, atol=atol)
    torch.testing.assert_close(v.double(), rv, rtol=rtol, atol=atol * 1e-3)
    torch.testing.assert_close(p.double(), rp, rtol=rtol, atol=atol)
    if lp is not None:
        assert torch.equal(param_lp, p.to(lp)), "param_lp must be the RNE cast of the new param"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # both branches of torch's lerp
def test_matches_torch_adamw_over_steps(backend, beta1):
    torch.manual_seed(0)
    n = 5003
    ref = torch.nn.Parameter(torch.randn(n))
    opt = torch.optim.AdamW(
        [ref], lr=3e-3, betas=(beta1, 0.95), eps=1e-6, weight_decay=0.1, foreach=False
    )
    p = ref.detach().clone()
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 21):
        g = torch.randn(n)
        ref.grad = g.clone()
        opt.step()
        ops.fused_adamw_(
            p,
            g,
            m,
            v,
            lr=3e-3,
            beta1=beta1,
            beta2=0.95,
            eps=1e-6,
            weight_decay=0.1,
            step=step,
            backend=backend,
        )
    torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_backends_agree_closely():
    if len(CPU_BACKENDS) < 2:
        pytest.skip("only one CPU backend built")
    outs = []
    for b in CPU_BACKENDS:
        p, g, m, v = make(65539, torch.bfloat16, seed=3)
        lp = torch.empty(65539, dtype=torch.bfloat16)
        ops.fused_adamw_(
            p,
            g,
            m,
            v,
            lr=1e-2,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            weight_decay=0.1,
            step=7,
            param_lp=lp,
            backend=b,
        )
        outs.append((p, m, v, lp))
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-6, atol=1e-7)


def test_large_parallel_path_matches_reference():
    # Big enough to take the multi-threaded path of the CPU kernel, unaligned length.
    n = (1 << 18) + 13
    p, g, m, v = make(n, torch.float16, seed=11)
    rp, rm, rv = reference64(
        p, g, m, v, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, step=3, grad_scale=1.0
    )
    ops.fused_adamw_(
        p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3
    )
    torch.testing.assert_close(p.double(), rp, rtol=ADAM_FP32[0], atol=ADAM_FP32[1])


def _args(n=16):
    p, g, m, v = make(n, torch.bfloat16)
    return dict(param=p, grad=g, exp_avg=m, exp_avg_sq=v)


HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)

BAD = [
    ("param", lambda a: a.update(param=a["param"].double()), TypeError),
    ("grad", lambda a: a.update(grad=a["grad"].int()), TypeError),
    ("exp_avg", lambda a: a.update(exp_avg=a["exp_avg"].half()), TypeError),
    ("exp_avg_sq", lambda a: a.update(exp_avg_sq=a["exp_avg_sq"][:8]), ValueError),
    ("param", lambda a: a.update(param=a["param"].view(4, 4)), ValueError),
    ("grad", lambda a: a.update(grad=torch.zeros(32, dtype=torch.bfloat16)[::2]), ValueError),
    ("grad", lambda a: a.update(grad=a["grad"][:15]), ValueError),
    ("exp_avg", lambda a: a.update(exp_avg=a["param"]), ValueError),  # aliasing
    # partial overlap: exp_avg_sq starts inside exp_avg
    ("exp_avg_sq", lambda a: a.update(exp_avg=(b := torch.zeros(24))[:16],
                                      exp_avg_sq=b[8:24]), ValueError),
]


@pytest.mark.parametrize("name,mutate,exc", BAD)
def test_bad_tensor_input_names_argument_and_writes_nothing(name, mutate, exc):
    a = _args()
    mutate(a)
    before = {k: v.clone() for k, v in a.items()}
    with pytest.raises(exc, match=name):
        ops.fused_adamw_(**a, **HP)
    for k, v in a.items():
        assert torch.equal(v, before[k]), f"{k} was modified"


@pytest.mark.parametrize(
    "kw,exc,name",
    [
        (dict(step=0), ValueError, "step"),
        (dict(step=1.5), TypeError, "step"),
        (dict(lr=-1.0), ValueError, "lr"),
        (dict(lr=float("inf")), ValueError, "lr"),
        (dict(eps=float("inf")), ValueError, "eps"),
        (dict(weight_decay=float("inf")), ValueError, "weight_decay"),
        (dict(beta1=1.0), ValueError, "beta1"),
        (dict(grad_scale=0.0), ValueError, "grad_scale"),
        (dict(backend="gpu"), ValueError, "backend"),
        (dict(param_lp=torch.zeros(16)), TypeError, "param_lp"),
        (dict(param_lp=torch.zeros(15, dtype=torch.bfloat16)), ValueError, "param_lp"),
    ],
)
def test_bad_scalar_input(kw, exc, name):
    a = _args()
    before = {k: v.clone() for k, v in a.items()}
    hp = {**HP, **kw}
    with pytest.raises(exc, match=name):
        ops.fused_adamw_(**a, **hp)
    for k, v in a.items():
        assert torch.equal(v, before[k])


def test_explicit_missing_backend_raises_clearly():
    a = _args()
    with pytest.raises(ValueError, match="cuda"):
        ops.fused_adamw_(**a, **HP, backend="cuda")


def test_opcheck():
    p, g, m, v = make(257, torch.bfloat16)
    lp = torch.empty(257, dtype=torch.bfloat16)
    args = (p, g, m, v, lp, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3, 2.0, CPU_BACKENDS[0])
    torch.library.opcheck(torch.ops.zerokern.fused_adamw_.default, args)


def test_inside_torch_compile():
    p, g, m, v = make(1031, torch.float32)
    p2, g2, m2, v2 = (t.clone() for t in (p, g, m, v))

    def step(p, g, m, v):
        ops.fused_adamw_(
            p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=5
        )

    torch.compile(step, fullgraph=False, backend="aot_eager")(p, g, m, v)
    step(p2, g2, m2, v2)
    assert torch.equal(p, p2) and torch.equal(m, m2) and torch.equal(v, v2)
