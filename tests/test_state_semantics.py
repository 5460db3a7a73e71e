"""State that says what it holds (issue 24, part 3): every way a DDP + torch.optim.AdamW script
reads or writes the optimizer's state either does what it does there, checked against DDP +
torch AdamW on the same data on 2 gloo ranks, or is refused by name before anything changes.

- torch AdamW's flags (amsgrad, maximize, ...) in the constructor, in param groups and in a
  loaded torch state dict; every other param-group key (a scheduler's initial_lr) kept;
- writes through ``opt.state``: the moments in place (also where a parameter straddles
  buckets), ``step``, ``del opt.state[p]``, ``opt.state = defaultdict(dict)``;
- stage 3: a parameter outside every param group keeps accumulating its gradient, as torch
  does, and trains as torch's after ``add_param_group``.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from _tol import TRAIN_FP32
from dist_utils import run_ranks
from models import OddNet, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import zerokern

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1],
                               msg=lambda m: f"{what}: {m}")


def _pair(stage, rank, params_of=None, offload=None):
    """OddNet under ZeroAdamW (stage 3: sharded; buckets of 61 elements, so parameters
    straddle them; ``offload``: its state in host memory) and an identical copy under DDP +
    torch AdamW."""
    torch.manual_seed(0)
    base = OddNet()
    ours = copy.deepcopy(base)
    if stage == 3:
        ours = zerokern.shard_model(ours)
    ref = copy.deepcopy(base)
    ddp = DDP(ref, find_unused_parameters=True)
    pick = params_of or (lambda m: [p for p in m.parameters() if p.requires_grad])
    opt = zerokern.ZeroAdamW(pick(ours), stage=stage, bucket_numel=61, offload=offload, **HP)
    ropt = torch.optim.AdamW(pick(ref), foreach=False, **HP)
    return ours, opt, ref, ddp, ropt


def _train(ours, opt, ddp, ropt, steps, start, rank, zero_grad=True):
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        F.cross_entropy(ours(x), y).backward()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        ropt.step()
        if zero_grad:
            opt.zero_grad()
            ropt.zero_grad()


def _same(ours, ref, what):
    full = zerokern.full_state_dict(ours, rank0_only=False)
    for n, p in ref.named_parameters():
        _close(full[n], p.detach(), f"{what}: {n}")


def _fresh(ref, stage):
    """A new OddNet holding the reference's weights (stage 3: sharded), for a new optimizer
    (a second optimizer on the same parameters would receive their gradients too)."""
    m = OddNet()
    m.load_state_dict(ref.state_dict())
    return zerokern.shard_model(m) if stage == 3 else m


def _snapshot(opt):
    sd = opt.state_dict()
    return copy.deepcopy(sd["state"]), copy.deepcopy(opt.param_groups)


def _unchanged(opt, snap, what):
    state, groups = _snapshot(opt)
    for k, v in snap[0].items():
        if torch.is_tensor(v):
            assert torch.equal(state[k], v), f"{what}: {k} changed"
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in snap[1]], what


# -- 1. torch AdamW's flags, and every other param-group key ---------------------------------
def flags_case(rank, world, stage):
    ours, opt, ref, ddp, ropt = _pair(stage, rank)
    params = [p for p in ours.parameters() if p.requires_grad]
    # The constructor: AdamW's signature; flags that change the math refused by name.
    for kw, name in ((dict(amsgrad=True), "amsgrad"), (dict(maximize=True), "maximize"),
                     (dict(differentiable=True), "differentiable")):
        with pytest.raises(ValueError, match=name):
            zerokern.ZeroAdamW(params, stage=stage, **kw)
    with pytest.raises(ValueError, match="amsgrad"):  # per group, as torch takes it
        zerokern.ZeroAdamW([{"params": params, "amsgrad": True}], stage=stage)
    with pytest.raises(ValueError, match="amsgrad"):  # positional, as in torch's signature
        zerokern.ZeroAdamW(params, 1e-3, (0.9, 0.999), 1e-8, 0.01, True, stage=stage)
    with pytest.raises(ValueError, match="decoupled_weight_decay"):  # with the default decay
        zerokern.ZeroAdamW([{"params": params, "decoupled_weight_decay": False}], stage=stage)
    _train(ours, opt, ddp, ropt, 2, 0, rank)
    # A flag set on a group later: refused at step(), before anything is updated.
    x, y = batch(2, rank)
    F.cross_entropy(ours(x), y).backward()
    before, weights = _snapshot(opt), zerokern.full_state_dict(ours, rank0_only=False)
    opt.param_groups[0]["maximize"] = True
    with pytest.raises(ValueError, match=r"maximize=True \(param group 0\)"):
        opt.step()
    del opt.param_groups[0]["maximize"]
    _unchanged(opt, before, "maximize set on a group")
    for k, v in zerokern.full_state_dict(ours, rank0_only=False).items():
        assert torch.equal(v, weights[k]), k
    opt.zero_grad()
    # Accepted, and not kept: they choose torch's kernels, not the update.
    fresh = _fresh(ref, stage)
    other = zerokern.ZeroAdamW([{"params": list(fresh.parameters()), "fused": True,
                                 "foreach": True}],
                               stage=stage, capturable=False, fused=None, foreach=False)
    assert "fused" not in other.param_groups[0] and "foreach" not in other.param_groups[0]
    # load_state_dict of a torch AdamW state with amsgrad / maximize / Adam's L2 decay:
    # refused by name, nothing changed.
    snap = _snapshot(opt)
    for key, value, name in (("amsgrad", True, "amsgrad"), ("maximize", True, "maximize"),
                             ("decoupled_weight_decay", False, "decoupled_weight_decay"),
                             ("differentiable", True, "differentiable")):
        sd = copy.deepcopy(ropt.state_dict())
        sd["param_groups"][0][key] = value
        with pytest.raises(ValueError, match=name):
            opt.load_state_dict(sd)
        _unchanged(opt, snap, name)
    # torch's implementation flags load, and training goes on exactly as torch's.
    sd = copy.deepcopy(ropt.state_dict())
    sd["param_groups"][0].update(foreach=True, fused=True, capturable=True)
    opt.load_state_dict(sd)
    assert "fused" not in opt.param_groups[0]
    _train(ours, opt, ddp, ropt, 2, 2, rank)
    _same(ours, ref, f"stage {stage} after loading torch's state")
    # full_state_dict gives torch AdamW's keys back (loadable by torch's AdamW).
    full = opt.full_state_dict(rank0_only=False)
    assert full["param_groups"][0]["amsgrad"] is False


@pytest.mark.parametrize("stage", [1, 3])
def test_torch_adamw_flags(stage, tmp_path):
    run_ranks(2, flags_case, stage, tmp_path=tmp_path)


def scheduler_resume_case(rank, world, stage, path):
    """The usual resume: optimizer state loaded, then StepLR(..., last_epoch=k), which needs
    every group's initial_lr; through torch's state dict, ZeroAdamW's own, full_state_dict
    and a checkpoint."""
    ours, opt, ref, ddp, ropt = _pair(stage, rank)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=2, gamma=0.5)
    for step in range(3):
        _train(ours, opt, ddp, ropt, 1, step, rank)
        sched.step()
        rsched.step()
    ropt.param_groups[0]["note"] = "kept"  # any key of a group travels with it
    rsd, k = copy.deepcopy(ropt.state_dict()), rsched.last_epoch

    def resume(load):
        # A new model with the reference's weights: the resumed run is compared with it.
        m = _fresh(ref, stage)
        o = zerokern.ZeroAdamW([p for p in m.parameters() if p.requires_grad], stage=stage,
                               bucket_numel=61, **HP)
        load(m, o)
        assert o.param_groups[0]["initial_lr"] == HP["lr"]
        assert o.param_groups[0]["note"] == "kept"
        return m, o, torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5,
                                                     last_epoch=k)

    r2 = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], foreach=False,
                           **HP)
    r2.load_state_dict(rsd)
    rs2 = torch.optim.lr_scheduler.StepLR(r2, step_size=2, gamma=0.5, last_epoch=k)
    m2, o2, s2 = resume(lambda m, o: o.load_state_dict(rsd))
    for step in range(3, 6):
        _train(m2, o2, ddp, r2, 1, step, rank)
        s2.step()
        rs2.step()
        assert o2.param_groups[0]["lr"] == r2.param_groups[0]["lr"]
    _same(m2, ref, f"stage {stage} resumed with StepLR")
    # ZeroAdamW's own state dict and full_state_dict carry the keys too.
    own, full = o2.state_dict(), o2.full_state_dict(rank0_only=False)
    for sd in (own, full):
        assert sd["param_groups"][0]["initial_lr"] == HP["lr"]
    resume(lambda m, o: o.load_state_dict(own))
    resume(lambda m, o: o.load_state_dict(full))
    # A checkpoint keeps the schedulers' keys (a key of the user's own is refused by name).
    with pytest.raises(zerokern.CheckpointError, match="'note'"):
        zerokern.save_checkpoint(path, m2, o2)
    for g in o2.param_groups:
        del g["note"]
    zerokern.save_checkpoint(path, m2, o2)

    def from_checkpoint(m, o):
        zerokern.load_checkpoint(path, m, o)
        o.param_groups[0]["note"] = "kept"

    resume(from_checkpoint)


@pytest.mark.parametrize("stage", [2, 3])
def test_scheduler_resume_keeps_group_keys(stage, tmp_path):
    run_ranks(2, scheduler_resume_case, stage, str(tmp_path / "ck"), tmp_path=tmp_path)


# -- 2. writes through opt.state -------------------------------------------------------------
def state_writes_case(rank, world, stage, offload=None):
    ours, opt, ref, ddp, ropt = _pair(stage, rank, offload=offload)
    _train(ours, opt, ddp, ropt, 2, 0, rank)
    pairs = [(p, rp) for p, rp in zip(ours.parameters(), ref.parameters())
             if p.requires_grad and rp in ropt.state]
    by_name = {n: i for i, (n, p) in enumerate(
        (n, p) for n, p in ours.named_parameters() if p in dict(pairs))}
    if stage in (1, 2):
        # Buckets of 61 elements: some parameter lies in several ranges of this rank.
        assert any(len(opt.state[p]["ranges"]) > 1 for p, _ in pairs)
    # What torch users do to a state, done to both (ours holds this rank's part of it).
    edits = {
        "emb.weight": lambda st, p: st["exp_avg"].zero_(),
        "fc1.weight": lambda st, p: st["exp_avg_sq"].mul_(0.25),
        "fc1.bias": lambda st, p: st["exp_avg"].copy_(torch.ones_like(st["exp_avg"])),
        "fc2.weight": lambda st, p: st.__setitem__("step", torch.tensor(10.0)),
        "fc2.bias": lambda st, p: st["step"].fill_(1.0),
        "norm.weight": lambda st, p: st.__setitem__("exp_avg", torch.full(p.shape, 0.01)),
    }
    for name, edit in edits.items():
        p, rp = pairs[by_name[name]]
        edit(opt.state[p], p)
        edit(ropt.state[rp], rp)
    held = opt.state[pairs[by_name["fc2.bias"]][0]]["step"]
    # A copy is a plain dict, a snapshot (torch's entries are plain dicts too).
    snap = copy.deepcopy(opt.state[pairs[by_name["fc1.weight"]][0]])
    assert type(snap) is dict and snap["exp_avg_sq"].data_ptr() != \
        opt.state[pairs[by_name["fc1.weight"]][0]]["exp_avg_sq"].data_ptr()
    # del opt.state[p]: the parameter starts afresh at its next step, as in torch.
    p, rp = pairs[by_name["norm.bias"]]
    del opt.state[p]
    del ropt.state[rp]
    assert p not in opt.state
    _train(ours, opt, ddp, ropt, 2, 2, rank)
    _same(ours, ref, f"stage {stage} after writing opt.state")
    assert held.item() == 3.0  # the step tensor a user holds counts, as torch's does
    for p, rp in pairs:
        assert opt.state[p]["step"].item() == ropt.state[rp]["step"].item()
    # The reset idiom.
    opt.state = defaultdict(dict)
    ropt.state = defaultdict(dict)
    assert len(opt.state) == 0
    _train(ours, opt, ddp, ropt, 2, 4, rank)
    _same(ours, ref, f"stage {stage} after opt.state = defaultdict(dict)")
    # What it cannot hold: refused, nothing changed.
    p = pairs[by_name["fc1.weight"]][0]
    st = opt.state[p]
    before = st["exp_avg"].clone()
    with pytest.raises(KeyError, match="'foo'"):
        st["foo"] = 1
    with pytest.raises(ValueError, match="shape"):
        st["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="whole number"):
        st["step"] = 1.5
    with pytest.raises(TypeError, match="reset"):
        del st["exp_avg"]
    with pytest.raises(TypeError, match="empty dict"):
        opt.state = {p: {}}
    assert torch.equal(opt.state[p]["exp_avg"], before)
    assert opt.state[p]["step"].item() == 2.0


@pytest.mark.parametrize("stage,offload", [(0, None), (1, None), (2, None), (3, None),
                                           (2, "cpu"), (3, "cpu")])
def test_state_writes_take_effect(stage, offload, tmp_path):
    run_ranks(2, state_writes_case, stage, offload, tmp_path=tmp_path)


# -- 4. a parameter outside every param group, added later ----------------------------------
def late_group_case(rank, world, stage, offload=None):
    """fc2 is in the model but not in the optimizer: its gradient accumulates (DDP averages
    it; opt.zero_grad() leaves it alone) until add_param_group, as in torch."""
    def without_fc2(m):
        return [p for n, p in m.named_parameters() if p.requires_grad
                and not n.startswith("fc2.")]

    ours, opt, ref, ddp, ropt = _pair(stage, rank, without_fc2, offload)
    _train(ours, opt, ddp, ropt, 3, 0, rank)
    for o, m in ((opt, ours), (ropt, ref)):
        o.add_param_group({"params": list(m.fc2.parameters()), "weight_decay": 0.0})
    _train(ours, opt, ddp, ropt, 3, 3, rank)
    _same(ours, ref, f"stage {stage} after add_param_group")


@pytest.mark.parametrize("stage,offload", [(2, None), (3, None), (3, "cpu")])
def test_param_added_later_keeps_accumulated_grad(stage, offload, tmp_path):
    run_ranks(2, late_group_case, stage, offload, tmp_path=tmp_path)
