"""Torch habits kept when porting a DDP + AdamW script (issue: drop-in for real): each either
trains exactly as DDP + torch.optim.AdamW (+ clip_grad_norm_) does on the same data, or is
refused with a clear error before anything changes."""

from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tol import TRAIN_FP32
from dist_utils import run_ranks
from models import OddNet, batch
from test_shards import _build
from test_zero_parity import _ref_average
from torch.nn.parallel import DistributedDataParallel as DDP

import zerokern

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1],
                               msg=lambda m: f"{what}: {m}")


def _step_both(opt, ropt):
    for o in (opt, ropt):
        o.step()
    for o in (opt, ropt):
        o.zero_grad()


def _same_params(ours, ref, what):
    """Every full parameter of ours (stage 3: gathered) equals the reference's."""
    full = zerokern.full_state_dict(ours, rank0_only=False)
    for n, p in ref.named_parameters():
        _close(full[n], p.detach(), f"{what} {n}")


def _decay_groups(model):
    """The common weight-decay rule of single-file GPT scripts: by p.dim()."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [dict(params=decay, weight_decay=0.1), dict(params=other, weight_decay=0.0)]


def replica(rank, world, stage, steps=20, accum=2, max_norm=0.05):
    """A single-file GPT-style training loop and its DDP version, side by side: two param
    groups by p.dim(), accumulation over micro-steps (DDP: no_sync; ours: opt.no_sync()),
    torch.nn.utils.clip_grad_norm_ that fires, evaluation on rank 0 only."""
    torch.manual_seed(0)
    base = OddNet()
    ours = copy.deepcopy(base)
    if stage == 3:
        ours = zerokern.shard_model(ours)
    # After shard_model too: released parameters keep their full shape, so p.dim() groups
    # as before and the counts match.
    groups = _decay_groups(ours)
    assert [len(g["params"]) for g in groups] == [len(g["params"]) for g in _decay_groups(base)]
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in base.parameters())
    opt = zerokern.ZeroAdamW(groups, stage=stage, bucket_numel=61, **HP)
    ref = copy.deepcopy(base)
    ddp = DDP(ref, find_unused_parameters=True)
    ropt = torch.optim.AdamW(_decay_groups(ref), foreach=False, **HP)
    fired = 0
    for step in range(steps):
        for mb in range(accum):
            x, y = batch(step * accum + mb, rank)
            last = mb == accum - 1
            with (opt.no_sync() if not last else _null()):
                (F.cross_entropy(ours(x), y) / accum).backward()
            with (ddp.no_sync() if not last else _null()):
                (F.cross_entropy(ddp(x), y) / accum).backward()
        n_ours = torch.nn.utils.clip_grad_norm_(ours.parameters(), max_norm)
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        assert math.isclose(n_ours.item(), n_ref.item(), rel_tol=1e-5), (step, n_ours, n_ref)
        fired += n_ref.item() > max_norm
        _step_both(opt, ropt)
    assert fired == steps, "clipping must fire on every step for this test to mean anything"
    _same_params(ours, ref, f"stage {stage}")
    if rank == 0:  # evaluation on rank 0 only (stages 0-2: the parameters are local)
        if stage < 3:
            with torch.no_grad():
                x, y = batch(999, 0)
                _close(ours(x), ref(x), "evaluation")


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def clip_method_case(rank, world, stage):
    ours, opt, ref, ropt = _build(stage, world, dict(HP, weight_decay=0.0))
    for step in range(4):
        x, y = batch(step, rank)
        F.cross_entropy(ours(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        _ref_average(ref, world)
        a = opt.clip_grad_norm_(0.02)
        b = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None],
                                           0.02)
        assert a.shape == () and math.isclose(a.item(), b.item(), rel_tol=1e-5)
        assert math.isclose(opt.last_grad_norm, b.item(), rel_tol=1e-5)
        _step_both(opt, ropt)
    # max_norm=inf (the HF Trainer's way to log the norm without clipping): the norm, and
    # the step is the unclipped one.
    x, y = batch(7, rank)
    F.cross_entropy(ours(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    _ref_average(ref, world)
    a = torch.nn.utils.clip_grad_norm_(ours.parameters(), math.inf)
    b = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None],
                                       math.inf)
    assert math.isclose(a.item(), b.item(), rel_tol=1e-5)
    _step_both(opt, ropt)
    _same_params(ours, ref, "clip")
    # A subset of the parameters, or a norm other than 2: refused, naming what to call.
    x, y = batch(9, rank)
    F.cross_entropy(ours(x), y).backward()
    with pytest.raises(ValueError, match="opt.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(list(ours.parameters())[:2], 1.0)
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm_(1.0, norm_type=1.0)


def ddp_wrap_case(rank, world, stage):
    torch.manual_seed(0)
    model = OddNet()
    if stage == 3:
        model = zerokern.shard_model(model)
    opt = zerokern.ZeroAdamW(model.parameters(), stage=stage)
    before = zerokern.full_state_dict(model, rank0_only=False)
    # wrapped after ZeroAdamW was built: refused by DDP's constructor
    with pytest.raises(RuntimeError, match="Remove the DDP"):
        DDP(model, find_unused_parameters=True)
    # wrapped before ZeroAdamW was built (the usual order of a DDP script): refused when
    # ZeroAdamW (stage 3: shard_model) is built, before anything changes
    torch.manual_seed(0)
    plain = OddNet()
    wrapped = DDP(plain, find_unused_parameters=True)
    snap = [p.detach().clone() for p in plain.parameters()]
    with pytest.raises(RuntimeError, match="Remove the DDP"):
        if stage == 3:
            zerokern.shard_model(plain)
        else:
            zerokern.ZeroAdamW(wrapped.parameters(), stage=stage)
    for a, p in zip(snap, plain.parameters()):
        assert torch.equal(a, p.detach())
    wrapped(batch(0, rank)[0]).sum().backward()  # DDP itself is untouched and still runs
    after = zerokern.full_state_dict(model, rank0_only=False)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(sh.step == 0 for sh in opt.shards())


def habits_case(rank, world, stage):
    torch.manual_seed(0)
    base = OddNet()
    ours = copy.deepcopy(base)
    ref = copy.deepcopy(base)
    params = list(ours.parameters())
    # listed twice: torch warns and updates it twice per step (and says this will become an
    # error); refused here, naming the group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="lists the same parameter twice"):
            zerokern.ZeroAdamW(params + [ours.fc1.weight], stage=stage, **HP)
    opt = zerokern.ZeroAdamW(params, stage=stage, **HP)
    ropt = torch.optim.AdamW(list(ref.parameters()), foreach=False, **HP)
    for step in range(4):
        x, y = batch(step, rank)
        F.cross_entropy(ours(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        _ref_average(ref, world)
        if step == 2:  # a gradient set by hand (same on every rank): used, as torch does
            g = torch.full_like(ours.unused.weight, 0.5)
            ours.unused.weight.grad = g.clone()
            ref.unused.weight.grad = g.clone()
        _step_both(opt, ropt)
        for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
            _close(a, b, f"step {step} {n}")
    # opt.state holds this rank's part of torch's state
    for p, rp in zip(ours.parameters(), ref.parameters()):
        st, rst = opt.state[p], ropt.state[rp]
        if not p.requires_grad or not rst:
            assert st == {}
            continue
        assert st["step"].item() == rst["step"].item()
        idx = torch.cat([torch.arange(s, s + n) for s, n in st["ranges"]]) if st["ranges"] \
            else torch.zeros(0, dtype=torch.long)
        _close(st["exp_avg"], rst["exp_avg"].reshape(-1)[idx], "exp_avg")
        _close(st["exp_avg_sq"], rst["exp_avg_sq"].reshape(-1)[idx], "exp_avg_sq")
    # step() twice after one backward: refused (torch would step with the same gradients)
    x, y = batch(7, rank)
    F.cross_entropy(ours(x), y).backward()
    opt.step()
    snap = [p.detach().clone() for p in ours.parameters()]
    with pytest.raises(RuntimeError, match="no backward since the last step"):
        opt.step()
    opt.zero_grad()
    opt.step()  # nothing to do, as in torch after zero_grad
    for a, p in zip(snap, ours.parameters()):
        assert torch.equal(a, p.detach())
    # a frozen parameter that requires grad later: refused at step()
    ours.frozen.requires_grad_(True)
    x, y = batch(8, rank)
    F.cross_entropy(ours(x), y).backward()
    with pytest.raises(RuntimeError, match="requires_grad=False"):
        opt.step()
    ours.frozen.requires_grad_(False)


def test_sparse_and_empty_models_are_refused():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = zerokern.ZeroAdamW(emb.parameters(), stage=2)
    with pytest.raises(TypeError, match="sparse gradients are not supported"):
        emb(torch.tensor([1, 2])).sum().backward()
    empty = torch.nn.Linear(0, 0)
    with pytest.raises(ValueError, match="0 elements"):
        zerokern.ZeroAdamW(empty.parameters(), stage=2)
    del opt


def test_state_dict_of_another_model_is_refused():
    a, b = OddNet(), OddNet(dim=14)
    oa = zerokern.ZeroAdamW(a.parameters(), stage=1)
    ob = zerokern.ZeroAdamW(b.parameters(), stage=1)
    for m, o in ((a, oa), (b, ob)):
        x, y = batch(0, 0)
        F.cross_entropy(m(x), y).backward()
        o.step()
    sd = ob.state_dict()
    before = oa.state_dict()
    with pytest.raises(ValueError, match="has shape .* another model"):
        oa.load_state_dict(sd)
    after = oa.state_dict()
    for k in ("exp_avg", "exp_avg_sq", "steps"):
        assert torch.equal(before["state"][k], after["state"][k])


def add_group_case(rank, world, stage):
    torch.manual_seed(0)
    base = OddNet()
    ours = copy.deepcopy(base)
    ref = copy.deepcopy(base)
    later = lambda m: [m.fc2.weight, m.fc2.bias]  # noqa: E731
    first = lambda m: [p for n, p in m.named_parameters()  # noqa: E731
                       if p.requires_grad and not n.startswith("fc2")]
    g_ours = first(ours)
    if stage == 3:
        ours = zerokern.shard_model(ours)
    opt = zerokern.ZeroAdamW(g_ours, stage=stage, bucket_numel=61, weight_decay=0.05, **HP)
    ropt = torch.optim.AdamW(first(ref), foreach=False, weight_decay=0.05, **HP)
    for step in range(5):
        if step == 2:  # the new group trains from this step on, in both
            for m in (ours, ref):
                for p in later(m):
                    p.grad = None
            opt.add_param_group(dict(params=later(ours), lr=1e-2, weight_decay=0.0))
            ropt.add_param_group(dict(params=later(ref), lr=1e-2, weight_decay=0.0))
        x, y = batch(step, rank)
        F.cross_entropy(ours(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        _ref_average(ref, world)
        _step_both(opt, ropt)
    _same_params(ours, ref, f"stage {stage}")
    assert [sh.step for sh in opt.shards()][-2:] == [3, 3]
    # A checkpoint covers the added group: a fresh optimizer built with both groups loads it.
    where = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(where)
    ck = os.path.join(where[0], "ck")
    zerokern.save_checkpoint(ck, ours, opt)
    g2 = [dict(params=first(ours)), dict(params=later(ours), lr=1e-2, weight_decay=0.0)]
    opt2 = zerokern.ZeroAdamW(g2, stage=stage, bucket_numel=61, weight_decay=0.05, **HP)
    zerokern.load_checkpoint(ck, ours, opt2)
    for a, b in zip(opt.shards(), opt2.shards()):
        assert a.step == b.step and a.shape == b.shape
        for ra, rb in zip(a.ranges, b.ranges):
            assert torch.equal(ra.exp_avg, rb.exp_avg) and torch.equal(ra.values, rb.values)
    assert opt2.param_groups[1]["lr"] == 1e-2
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where[0])
    # refused between a backward and its step, unchanged (opt2, built over all of opt's
    # parameters while opt lives, trains them now: opt's add_param_group is refused too)
    x, y = batch(9, rank)
    F.cross_entropy(ours(x), y).backward()
    if stage < 3:
        n_groups = len(opt2.param_groups)
        with pytest.raises(RuntimeError, match="between backward"):
            opt2.add_param_group(dict(params=[ours.unused.weight]))
        assert len(opt2.param_groups) == n_groups
        with pytest.raises(RuntimeError, match=r"add_param_group\(\): a newer zerokern"):
            opt.add_param_group(dict(params=[ours.unused.weight]))


def carry_case(rank, world, stage):
    """No zero_grad() between steps (torch accumulates across steps): stage 0 does as torch,
    stage 1 refuses before updating, stages 2-3 warn (they cannot tell it from
    model.zero_grad())."""
    ours, opt, ref, ropt = _build(stage, world)
    kept: list = []  # torch's averaged gradients of the last step, still on .grad
    for step in range(3):
        x, y = batch(step, rank)
        F.cross_entropy(ours(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        if step == 0:
            _ref_average(ref, world)
        else:  # torch's .grad holds last step's average plus this step's local gradient
            for p, prev in zip(ref.parameters(), kept):
                if p.grad is not None and prev is not None:
                    p.grad.sub_(prev)
            _ref_average(ref, world)
            for p, prev in zip(ref.parameters(), kept):
                if p.grad is not None and prev is not None:
                    p.grad.add_(prev)
        kept = [None if p.grad is None else p.grad.clone() for p in ref.parameters()]
        if stage == 1 and step == 1:
            snap = [p.detach().clone() for p in ours.parameters()]
            with pytest.raises(RuntimeError, match="accumulate gradients across steps"):
                opt.step()
            assert all(torch.equal(a, p.detach()) for a, p in zip(snap, ours.parameters()))
            return
        if stage >= 2 and step == 1:
            with pytest.warns(UserWarning, match="no opt.zero_grad"):
                opt.step()
            return
        opt.step()
        ropt.step()  # neither zeroes its gradients
        if stage == 0:
            for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
                _close(a, b, f"step {step} {n}")


# Every case on 2 ranks at each stage where it applies (the habits case covers stages 0-2: its
# hand-set gradient and state checks use the unsharded model).
CASES = {
    "ported_gpt_script_matches_ddp": (replica, [0, 1, 2, 3]),
    "clip_grad_norm_method_is_global": (clip_method_case, [0, 1, 2, 3]),
    "ddp_wrapped_model_is_refused": (ddp_wrap_case, [0, 1, 2, 3]),
    "torch_habits_behave_as_adamw_or_are_refused": (habits_case, [0, 1, 2]),
    "add_param_group_trains_the_new_group_as_torch": (add_group_case, [0, 1, 2, 3]),
    "steps_without_zero_grad": (carry_case, [0, 1, 2, 3]),
}


@pytest.mark.parametrize("case,stage", [(c, s) for c, (_, st) in CASES.items() for s in st])
def test_on_two_ranks(case, stage, tmp_path):
    run_ranks(2, CASES[case][0], stage, tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_model_moved_after_construction_trains_where_it_is(stage):
    """Accelerate's prepare (and the HF Trainer with optimizers=) move the model after the
    optimizer was built: ZeroAdamW lays out where the parameters are at the first step, as
    torch's AdamW follows them. Here the move is a cast (the only move a CPU has): the
    parameters stay bfloat16 and train as with a ZeroAdamW built after the cast."""
    torch.manual_seed(0)
    base = OddNet()
    moved, direct = copy.deepcopy(base), copy.deepcopy(base).to(torch.bfloat16)
    opt_m = zerokern.ZeroAdamW(moved.parameters(), stage=stage, **HP)
    moved.to(torch.bfloat16)
    opt_d = zerokern.ZeroAdamW(direct.parameters(), stage=stage, **HP)
    for step in range(3):
        for model, opt in ((moved, opt_m), (direct, opt_d)):
            x, y = batch(step, 0)
            F.cross_entropy(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
    for (n, a), b in zip(moved.named_parameters(), direct.parameters(), strict=True):
        assert a.dtype == torch.bfloat16, n
        assert torch.equal(a, b), n


def weights_written_case(rank, world, stage, dtype, offload):
    """model.load_state_dict(W) after ZeroAdamW was built (and has stepped): as with torch's
    AdamW, training goes on from W. ZeroAdamW's fp32 master (16-bit parameters; with offload,
    every parameter) takes W at the next step. A step at lr 0 must leave exactly W."""
    torch.manual_seed(0)
    model = OddNet().to(dtype)
    if stage == 3:
        model = zerokern.shard_model(model)
    kw = dict(offload="cpu") if offload else {}
    opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, weight_decay=0.0, **HP, **kw)
    for step in range(2):
        x, y = batch(step, rank)
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(1)
    w = {k: v.to(dtype) for k, v in OddNet().state_dict().items()}
    model.load_state_dict(w)
    for g in opt.param_groups:
        g["lr"] = 0.0
    x, y = batch(5, rank)
    F.cross_entropy(model(x).float(), y).backward()
    opt.step()
    opt.zero_grad()
    got = zerokern.full_state_dict(model, rank0_only=False)
    for k, v in w.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("stage,dtype,offload", [
    (0, torch.bfloat16, False), (1, torch.bfloat16, False), (2, torch.bfloat16, False),
    (3, torch.bfloat16, False), (2, torch.float32, True), (3, torch.float32, True),
])
def test_weights_loaded_after_construction_are_trained_from(stage, dtype, offload, tmp_path):
    run_ranks(2, weights_written_case, stage, dtype, offload, tmp_path=tmp_path)
