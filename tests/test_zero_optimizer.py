"""ZeroOptimizer(params, optimizer_class, **defaults): torch's element-wise optimizers (and a
user subclass) at stages 0-3 against DDP-style averaging + the same torch class, on gloo ranks.

The model's loss is linear in every parameter with small-integer coefficients (models.IntGradNet),
so every averaged gradient is exact in any summation order: both sides then run the class's
own update on the same fp32 numbers, ours over the flat shard (a view of several parameters
at once, cut anywhere), the reference per parameter. Tolerance: each step of each element is
the same sequence of fp32 operations on the same inputs; what may differ is only how the
kernels evaluate an operation over a longer or shorter, differently aligned tensor (vector
body vs scalar tail, a fused multiply-add in one of them), at most one rounding per operation,
U = 2**-24 relative. The updates of these classes take at most about 20 operations per element
and step, none of which amplifies an earlier rounding by more than a factor of a few (the
divisions are by sqrt(v) + eps of the same rounded v on both sides... the largest factor is
lr / eps-limited steps of Adagrad/RMSprop, about 1), so after STEPS steps the parameters agree
to within STEPS * 20 * 4 * U relative to their size, plus as much of lr absolute:
``rtol = atol = STEPS * 80 * U`` (about 1.4e-5 for 3 steps). In practice they agree bit for bit.

Each multi-rank case loops over classes and stages in one run_ranks call (the pool is formed
once per world size), with tiny models and three steps.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
from _tol import U_FP32
from dist_utils import run_ranks
from models import IntGradNet
from test_zero_parity import _ref_average

import zerokern
from zerokern.zero.registry import runtime_of_module

STEPS = 3
TOL = STEPS * 80 * U_FP32


class MySGD(torch.optim.SGD):
    """A user subclass that keeps torch's SGD step: element-wise as its base."""

    def __init__(self, params, lr=0.05, **kw):
        super().__init__(params, lr=lr, momentum=0.8, **kw)


class SignSGD(torch.optim.Optimizer):
    """A user optimizer with its own element-wise step (declares it)."""

    zerokern_elementwise = True

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["step"] = st.get("step", 0) + 1
                buf = st.setdefault("trace", torch.zeros_like(p))
                buf.mul_(0.5).add_(p.grad)
                p.add_(buf.sign(), alpha=-g["lr"])


CASES = [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr=0.01, weight_decay=0.02, amsgrad=True)),
    (torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.05)),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.2,
                               weight_decay=0.01)),
    (torch.optim.RMSprop, dict(lr=0.01, centered=True, momentum=0.5, weight_decay=0.01)),
    (torch.optim.NAdam, dict(lr=0.01, weight_decay=0.01, momentum_decay=0.01)),
    (torch.optim.RAdam, dict(lr=0.01, weight_decay=0.01)),
    (torch.optim.Adamax, dict(lr=0.01, weight_decay=0.01)),
    # Adadelta's two buffers, Rprop's sign-driven step sizes (its prev gradient and step
    # sizes as buffers), ASGD's per-parameter scalars eta and mu with averaging from step 1.
    (torch.optim.Adadelta, dict(lr=0.5, rho=0.8, eps=1e-5, weight_decay=0.01)),
    (torch.optim.Rprop, dict(lr=0.02, etas=(0.4, 1.3), step_sizes=(1e-4, 0.5))),
    (torch.optim.ASGD, dict(lr=0.02, lambd=1e-3, alpha=0.7, t0=1, weight_decay=0.01)),
    (MySGD, dict(lr=0.03)),
    (SignSGD, dict(lr=0.01)),
    # No momentum: no per-element buffer at all (its shards hold only the values).
    (torch.optim.SGD, dict(lr=0.05, weight_decay=0.01)),
]


def _loss(model, step, rank):
    # "d" (IntGradNet) takes part on even steps only: per-parameter step counts differ.
    return model(step, rank, step % 2 == 0)


def _compare(ours, ref, what, exact=False):
    sharded = runtime_of_module(ours) is not None  # stage 3: gather them
    full = zerokern.full_state_dict(ours, rank0_only=False) if sharded else \
        dict(ours.named_parameters())
    for (name, _), b in zip(ours.named_parameters(), ref.parameters()):
        a = full[name]
        if exact:
            assert torch.equal(a.detach(), b.detach()), f"{what}: {name}"
        else:
            torch.testing.assert_close(a.detach(), b.detach(), rtol=TOL, atol=TOL,
                                       msg=lambda m, n=name: f"{what}: {n}: {m}")


def _train(model, opt, ref, ropt, world, rank, start, steps):
    for step in range(start, start + steps):
        if model is not None:
            _loss(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
        if ref is not None:
            _loss(ref, step, rank).backward()
            _ref_average(ref, world)
            ropt.step()
            ropt.zero_grad()


def _build(base, cls, hp, stage, **kw):
    model = copy.deepcopy(base)
    if stage == 3:
        mesh = kw.pop("model_mesh", None)
        model = zerokern.shard_model(model, **({} if mesh is None else {"mesh": mesh}))
    return model, zerokern.ZeroOptimizer(model.parameters(), cls, stage=stage,
                                         bucket_numel=61, **kw, **hp)


def parity_case(rank, world, *, stages, cases, offload=False, mesh=False):
    torch.manual_seed(0)
    base = IntGradNet()
    extra = {}
    if mesh:
        from test_hybrid import _mesh

        extra["mesh"] = _mesh()
    for cls, hp in cases:
        for stage in stages:
            kw = dict(extra)
            if offload and stage > 0:
                kw["offload"] = "cpu"
            if mesh and stage == 3:
                kw["model_mesh"] = kw.pop("mesh")
            model, opt = _build(base, cls, hp, stage, **kw)
            ref = copy.deepcopy(base)
            ropt = cls(ref.parameters(), **hp)
            _train(model, opt, ref, ropt, world, rank, 0, STEPS)
            what = f"{cls.__name__}{hp} stage {stage} offload {offload} mesh {mesh}"
            _compare(model, ref, what)
            _compare_state(opt, ref, ropt, what)


def _compare_state(opt, ref, ropt, what):
    """The state, in the class's own keys, as torch's holds it."""
    full = opt.full_state_dict(rank0_only=False)
    want = ropt.state_dict()
    # Adagrad fills a state for every parameter at construction, frozen ones too:
    # ZeroOptimizer's state is of the parameters it trains.
    trained = [i for i, p in enumerate(ref.parameters()) if p.requires_grad]
    want["state"] = {i: st for i, st in want["state"].items() if i in trained}
    assert set(full["state"]) == set(want["state"]), what
    for i, st in want["state"].items():
        assert set(full["state"][i]) == set(st), (what, i, set(full["state"][i]), set(st))
        for k, v in st.items():
            got = full["state"][i][k]
            if torch.is_tensor(v):
                torch.testing.assert_close(got.float(), v.float(), rtol=TOL, atol=TOL,
                                           msg=lambda m, w=f"{what} {i} {k}": f"{w}: {m}")
            else:
                assert got == v, (what, i, k)


@pytest.mark.parametrize("world", [2])
def test_elementwise_classes_match_ddp_at_every_stage(world, tmp_path):
    run_ranks(world, parity_case, dict(stages=(0, 1, 2, 3), cases=CASES), tmp_path=tmp_path,
              kwargs=True)


def test_offload_and_three_ranks(tmp_path):
    pick = [CASES[1], CASES[6], CASES[4]]
    run_ranks(3, parity_case, dict(stages=(1, 2, 3), cases=pick, offload=True),
              tmp_path=tmp_path, kwargs=True)


def test_two_d_mesh(tmp_path):
    pick = [CASES[0], CASES[6], CASES[5]]
    run_ranks(4, parity_case, dict(stages=(0, 2, 3), cases=pick, mesh=True),
              tmp_path=tmp_path, kwargs=True)


FP16_SCALE = 256.0  # static: a scaled gradient (coefficient x 256) stays an exact fp16 value


def fp16_case(rank, world, *, stages, cases):
    """fp16 parameters through the torch-class path, as the project trains fp16: a loss
    scale, the gradients reduced in fp16, unscaled, the class's step on an fp32 master, the
    parameters its fp16 rounding. Reference: the same class on fp32 parameters (the fp16
    initial values, upcast) fed the same averaged gradients: IntGradNet's gradients are small
    integers, exact scaled by 256 in fp16, summed and averaged over two ranks (multiples of
    128), so both sides step on the same numbers. The fp32 state must match within TOL and
    the fp16 parameters the reference's rounding, within one fp16 unit (a master within TOL
    of a rounding tie may round the other way); stepping the fp16 values themselves (no
    master) would drift from the reference by several units in three steps."""
    torch.manual_seed(0)
    base = IntGradNet().half()
    for cls, hp in cases:
        for stage in stages:
            what = f"fp16 {cls.__name__} stage {stage}"
            model, opt = _build(base, cls, hp, stage, loss_scale=FP16_SCALE)
            ref = copy.deepcopy(base).float()
            ropt = cls(ref.parameters(), **hp)
            for step in range(STEPS):
                opt.scale_loss(_loss(model, step, rank)).backward()
                opt.step()
                opt.zero_grad()
                _loss(ref, step, rank).backward()
                _ref_average(ref, world)
                ropt.step()
                ropt.zero_grad()
            assert opt.scaler.skipped_steps == 0, what
            sharded = runtime_of_module(model) is not None
            full = zerokern.full_state_dict(model, rank0_only=False) if sharded else \
                dict(model.named_parameters())
            for (name, _), b in zip(model.named_parameters(), ref.parameters()):
                a = full[name].detach()
                assert a.dtype == torch.float16, (what, name, a.dtype)
                torch.testing.assert_close(a.float(), b.detach().half().float(), rtol=2**-10,
                                           atol=0, msg=lambda m, w=f"{what}: {name}": f"{w}: {m}")
            _compare_state(opt, ref, ropt, what)  # the fp32 state, stepped on the master


def test_fp16_parameters_with_a_loss_scale(tmp_path):
    pick = [CASES[2], CASES[9], CASES[11]]  # Adam (amsgrad), Adadelta, ASGD
    run_ranks(2, fp16_case, dict(stages=(0, 1, 2, 3), cases=pick), tmp_path=tmp_path,
              kwargs=True)


def adamw_case(rank, world):
    torch.manual_seed(0)
    base = IntGradNet()
    hp = dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.05, foreach=False)
    for stage in (1, 3):
        a, oa = _build(base, torch.optim.AdamW, hp, stage)
        b = copy.deepcopy(base)
        if stage == 3:
            b = zerokern.shard_model(b)
        ob = zerokern.ZeroAdamW(b.parameters(), stage=stage, bucket_numel=61, **hp)
        assert oa.rule is ob.rule is zerokern.ZeroAdamW.rule
        assert oa.param_groups[0].keys() == ob.param_groups[0].keys()
        for step in range(STEPS):
            for m, o in ((a, oa), (b, ob)):
                _loss(m, step, rank).backward()
                o.step()
                o.zero_grad()
        fa = zerokern.full_state_dict(a, rank0_only=False)
        fb = zerokern.full_state_dict(b, rank0_only=False)
        for k in fa:
            assert torch.equal(fa[k], fb[k]), (stage, k)


def test_adamw_class_is_zeroadamw_bit_for_bit(tmp_path):
    run_ranks(2, adamw_case, tmp_path=tmp_path)


def interchange_case(rank, world, *, path):
    """torch state dict both ways, per-rank state dicts, and checkpoints across stages."""
    torch.manual_seed(0)
    base = IntGradNet()
    for n, (cls, hp) in enumerate([CASES[1], CASES[4], CASES[6]]):
        what = cls.__name__
        model, opt = _build(base, cls, hp, 2)
        ref = copy.deepcopy(base)
        ropt = cls(ref.parameters(), **hp)
        _train(model, opt, ref, ropt, world, rank, 0, STEPS)
        # ours -> torch: the class continues from our state as from its own.
        r2 = copy.deepcopy(ref)
        r2opt = cls(r2.parameters(), **hp)
        r2opt.load_state_dict(opt.full_state_dict(rank0_only=False))
        # torch -> ours, at another stage.
        m3, o3 = _build(ref, cls, hp, 3)
        o3.load_state_dict(ropt.state_dict())
        # a checkpoint at stage 2, loaded at stage 1
        ck = os.path.join(path, f"ck{n}")
        zerokern.save_checkpoint(ck, model, opt)
        m4, o4 = _build(base, cls, hp, 1)
        zerokern.load_checkpoint(ck, m4, o4)
        # this rank's state dict, into a fresh optimizer of the same layout
        sd = opt.state_dict()
        m5, o5 = _build(model, cls, hp, 2)
        o5.load_state_dict(sd)
        _train(model, opt, ref, ropt, world, rank, STEPS, STEPS)
        for m, o, label in ((m3, o3, "torch->ours"), (m4, o4, "checkpoint"),
                            (m5, o5, "state_dict")):
            _train(m, o, None, None, world, rank, STEPS, STEPS)
            _compare(m, ref, f"{what} {label}")
        _train(None, None, r2, r2opt, world, rank, STEPS, STEPS)
        _compare(model, r2, f"{what} ours->torch")


def test_state_dicts_and_checkpoints_round_trip(tmp_path):
    run_ranks(2, interchange_case, dict(path=str(tmp_path)), tmp_path=tmp_path, kwargs=True)


def test_checkpoint_of_another_class_is_refused(tmp_path):
    torch.manual_seed(0)
    model = IntGradNet()
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=1, lr=0.1,
                                 momentum=0.9)
    _train(model, opt, None, None, 1, 0, 0, 1)
    zerokern.save_checkpoint(tmp_path / "ck", model, opt)
    other = zerokern.ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=1, lr=0.1)
    with pytest.raises(zerokern.CheckpointError, match="torch.optim.SGD.*torch.optim.Adam"):
        zerokern.load_checkpoint(tmp_path / "ck", model, other)


def test_sgd_without_momentum_keeps_no_state_and_checkpoints(tmp_path):
    # A class that keeps no per-element buffer: shards() of values alone, torch's empty
    # state dict both ways, a checkpoint saved at stage 2 and loaded at stage 1.
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    hp = dict(lr=0.1, weight_decay=0.01)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=2, **hp)
    ropt = torch.optim.SGD(ref.parameters(), **hp)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    for m, o in ((model, opt), (ref, ropt)):
        for _ in range(2):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    assert [r.keys for s in opt.shards() for r in s.ranges] == [("values",)] * 4
    assert opt.full_state_dict()["state"] == ropt.state_dict()["state"] == {}
    opt.load_state_dict(ropt.state_dict())
    zerokern.save_checkpoint(tmp_path / "ck", model, opt)
    m2 = copy.deepcopy(base)
    o2 = zerokern.ZeroOptimizer(m2.parameters(), torch.optim.SGD, stage=1, **hp)
    zerokern.load_checkpoint(tmp_path / "ck", m2, o2)
    for m in (model, m2):
        m(x).square().sum().backward()
    ref(x).square().sum().backward()
    for o in (opt, o2, ropt):
        o.step()
    for m in (model, m2):
        for a, b in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


def test_checkpoint_of_adamw_with_amsgrad_into_fused_adamw_names_the_flags(tmp_path):
    # Both sides are torch.optim.AdamW: the message must say what differs (the rule), not
    # name the same class twice.
    torch.manual_seed(0)
    model = IntGradNet()
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=0.1,
                                 amsgrad=True)
    _train(model, opt, None, None, 1, 0, 0, 1)
    zerokern.save_checkpoint(tmp_path / "ck", model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    fused = zerokern.ZeroAdamW(model.parameters(), stage=1, lr=0.1)
    with pytest.raises(zerokern.CheckpointError,
                       match=r"AdamW by torch's own step \(amsgrad=True.*max_exp_avg_sq.*"
                             r"AdamW as zerokern's fused AdamW.*checkpoint's flags"):
        zerokern.load_checkpoint(tmp_path / "ck", model, fused)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# -- refused --------------------------------------------------------------------------------------
class Whole(torch.optim.Optimizer):
    """Reads whole tensors (normalises each update): not element-wise, and not declared."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p.data.add_(p.grad / p.grad.norm(), alpha=-g["lr"])


class ScriptMuon(Whole):
    """A script's own Muon (modded-nanogpt's): whole matrices, undeclared."""


@pytest.mark.parametrize("cls,match", [
    (ScriptMuon, r"ScriptMuon: ZeroOptimizer cannot tell.*train it with DDP\. For a Muon.*do "
                 r"not declare it.*use torch\.optim\.Muon"),
    (torch.optim.LBFGS, r"torch.optim.LBFGS is not supported by ZeroOptimizer: it runs a line "
                        r"search"),
    (torch.optim.SparseAdam, "SparseAdam is not supported.*sparse gradients"),
    (getattr(torch.optim, "Adafactor", None), "Adafactor is not supported.*row and column"),
    (Whole, r"Whole: ZeroOptimizer cannot tell whether its update is element-wise.*"
            r"zerokern_elementwise = True.*elementwise=True"),
])
def test_not_elementwise_is_refused_at_construction(cls, match):
    if cls is None:
        pytest.skip("not in this torch")
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=match):
        zerokern.ZeroOptimizer([p], cls, stage=1)
    assert p.grad is None and torch.equal(p, torch.zeros(4, 4))


def test_declared_elementwise_is_taken_and_bad_arguments_are_refused():
    p = torch.nn.Parameter(torch.ones(5))
    opt = zerokern.ZeroOptimizer([p], Whole, stage=1, elementwise=True)  # the caller's word
    assert opt.rule.torch_class is Whole
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer"):
        zerokern.ZeroOptimizer([p], torch.optim.SGD([p]), stage=1)
    # The class's own checks, with its own message.
    with pytest.raises(ValueError, match="torch.optim.SGD: Invalid learning rate: -1"):
        zerokern.ZeroOptimizer([p], torch.optim.SGD, stage=1, lr=-1)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        zerokern.ZeroOptimizer([p], torch.optim.SGD, stage=1, lr=0.1, nesterov=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'betas'"):
        zerokern.ZeroOptimizer([p], torch.optim.SGD, stage=1, lr=0.1, betas=(0.9, 0.9))
    with pytest.raises(ValueError, match="moments='int8'.*torch.optim.AdamW only.*Adam"):
        zerokern.ZeroOptimizer([p], torch.optim.Adam, stage=1, moments="int8")
    with pytest.raises(ValueError, match="differentiable=True"):
        zerokern.ZeroOptimizer([p], torch.optim.Adam, stage=1, differentiable=True)
    # AdamW with AMSGrad: torch's own step (the fused kernels have no running maximum).
    amsgrad = zerokern.ZeroOptimizer([p], torch.optim.AdamW, stage=1, amsgrad=True)
    assert amsgrad.rule.state_names == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert torch.equal(p, torch.ones(5))


def test_a_group_needing_a_buffer_it_was_not_built_with_is_refused_at_step():
    p = torch.nn.Parameter(torch.ones(5))
    opt = zerokern.ZeroOptimizer([p], torch.optim.SGD, stage=1, lr=0.1)  # no momentum
    p.sum().backward()
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match=r"need the state \['momentum_buffer'\]"):
        opt.step()
    assert torch.equal(p, torch.ones(5))
    opt.param_groups[0]["lr"] = -1.0
    opt.param_groups[0]["momentum"] = 0
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()


def differing_case(rank, world):
    p = torch.nn.Parameter(torch.ones(6))
    cases = [
        (dict(optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9 if rank else 0.8),
         r"momentum \(param group 0\) is 0.8 on rank 0, 0.9 on rank 1"),
        (dict(optimizer_class=torch.optim.SGD if rank else torch.optim.Adam, lr=0.1),
         r"optimizer is 'torch.optim.Adam' on rank 0, 'torch.optim.SGD' on rank 1"),
        (dict(optimizer_class=torch.optim.SGD, lr=0.1, momentum=-1.0 if rank else 0.9),
         "(failed on rank 1.*)?Invalid momentum value"),
    ]
    for kw, match in cases:
        cls = kw.pop("optimizer_class")
        with pytest.raises(ValueError, match=match):
            zerokern.ZeroOptimizer([p], cls, stage=1, **kw)
    dist.barrier()


def test_options_that_differ_across_ranks_are_refused_on_every_rank(tmp_path):
    run_ranks(2, differing_case, tmp_path=tmp_path)


def test_scalars_advance_once_per_parameter_split_over_buckets():
    # NAdam's mu_product: a parameter split over several buckets (ranges) advances once.
    torch.manual_seed(0)
    model = torch.nn.Linear(40, 30)
    ref = copy.deepcopy(model)
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.NAdam, stage=2,
                                 bucket_numel=64, lr=0.01)
    ropt = torch.optim.NAdam(ref.parameters(), lr=0.01)
    for step in range(STEPS):
        x = torch.randn(3, 40, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ropt)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    want = ropt.state[ref.weight]["mu_product"]
    got = opt.full_state_dict()["state"][0]["mu_product"]
    assert math.isclose(float(got), float(want), rel_tol=0, abs_tol=0)
    torch.testing.assert_close(model.weight, ref.weight, rtol=TOL, atol=TOL)


def test_a_rule_without_buffers_checkpoints_and_resumes(tmp_path):
    """torch SGD without momentum keeps no state at all (Lightning's transformer example trains
    with it): its checkpoint holds the parameters only, loads at another stage, resumes as
    torch SGD goes on, and consolidates to the plain weights."""
    from safetensors.torch import load_file

    from zerokern.cli.consolidate import consolidate

    torch.manual_seed(0)
    base = IntGradNet()
    hp = dict(lr=0.05)
    model, opt = _build(base, torch.optim.SGD, hp, 2)
    ref = copy.deepcopy(base)
    ropt = torch.optim.SGD(ref.parameters(), **hp)
    _train(model, opt, None, None, 1, 0, 0, STEPS)
    _train_alone(ref, ropt, 0, STEPS)
    zerokern.save_checkpoint(tmp_path / "ck", model, opt)
    consolidate(str(tmp_path / "ck"), str(tmp_path / "full.safetensors"))
    full = load_file(tmp_path / "full.safetensors")
    for name, p in ref.named_parameters():
        assert torch.equal(full[name], p.detach()), name
    for stage in (1, 3):
        m2, o2 = _build(base, torch.optim.SGD, hp, stage)
        zerokern.load_checkpoint(tmp_path / "ck", m2, o2)
        _train(m2, o2, None, None, 1, 0, STEPS, STEPS)
        if stage == 1:
            _train_alone(ref, ropt, STEPS, STEPS)
        _compare(m2, ref, f"SGD without momentum, resumed at stage {stage}")


def _train_alone(ref, ropt, start, steps):
    # One process (no group): torch's optimizer on the gradients as they are.
    for step in range(start, start + steps):
        _loss(ref, step, 0).backward()
        ropt.step()
        ropt.zero_grad()
