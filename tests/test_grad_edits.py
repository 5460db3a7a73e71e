"""Gradients edited between backward and step() (issue 35, items 6, 7, 8, 16): each behaves as
DDP + torch.optim.AdamW(foreach=False) does on the same data, or is refused on every rank with
an error naming the parameter.

- ``p.grad = t`` after backward (the same t on every rank): stepped with as it is, with or
  without clipping after it, and a further backward adds to it;
- ``p.grad = None`` after backward: that parameter is skipped (no update, no decay, no state
  change, its step count stays); a further backward gives it a fresh gradient;
- ranks that disagree on such an edit, or set different values (one element of one rank
  is enough): refused on every rank, nothing updated, and training goes on after
  opt.zero_grad(); an edit after clip_grad_norm_: refused;
- add_param_group after gradients accumulated on the new parameters (under opt.zero_grad()
  only, which does not reach them): their accumulated gradient, averaged over the ranks, is
  used; zero_grad(set_to_none=False) keeps zeros only where a gradient existed, as torch;
- stages 1-3: clearing gradients with model.zero_grad() (either form) after each step is
  neither warned nor refused; a gradient really carried over warns (stages 2-3) or is refused
  (stage 1); the last step's gradient, which no rank keeps whole, is not readable.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
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


def _pair(stage, named=False, params=None):
    """OddNet under ZeroAdamW (stage 3: sharded) and a copy under DDP + torch AdamW.
    ``params(model)``: the parameters each optimizer starts with (default all)."""
    torch.manual_seed(0)
    base = OddNet()
    ours = copy.deepcopy(base)
    ref = copy.deepcopy(base)
    pick = params or (lambda m: [p for p in m.parameters() if p.requires_grad])
    first = pick(ours)
    if stage == 3:
        ours = zerokern.shard_model(ours)
    if named:
        keep = {id(p) for p in first}
        first = [(n, p) for n, p in ours.named_parameters() if id(p) in keep]
    opt = zerokern.ZeroAdamW(first, stage=stage, bucket_numel=61, **HP)
    ddp = DDP(ref, find_unused_parameters=True)
    ropt = torch.optim.AdamW(pick(ref), foreach=False, **HP)
    return ours, opt, ref, ddp, ropt


def _backward(ours, ddp, step, rank):
    x, y = batch(step, rank)
    F.cross_entropy(ours(x), y).backward()
    F.cross_entropy(ddp(x), y).backward()


def _same(ours, opt, ref, ropt, what):
    """Every full parameter (stage 3: gathered) and every step count equal torch's."""
    full = zerokern.full_state_dict(ours, rank0_only=False)
    for n, p in ref.named_parameters():
        _close(full[n], p.detach(), f"{what}: {n}")
    steps = [int(ropt.state[p]["step"]) if ropt.state.get(p) else 0
             for g in ropt.param_groups for p in g["params"]]
    assert [sh.step for sh in opt.shards()] == steps, what


def _set(models, name, value):
    for m in models:
        p = m.get_parameter(name)
        p.grad = None if value is None else torch.full(p.shape, value)


# -- item 6: p.grad = t after backward ---------------------------------------------------------
def hand_set_case(rank, world, stage, clip):
    ours, opt, ref, ddp, ropt = _pair(stage)
    for step in range(5):
        _backward(ours, ddp, step, rank)
        if step in (1, 2):
            _set((ours, ref), "fc1.weight", 0.02)  # replaces the averaged gradient
        if step == 2:
            _set((ours, ref), "unused.weight", 0.5)  # a parameter autograd left alone
        if step == 3:  # set, then a further backward of the same step adds to it
            _set((ours, ref), "fc2.bias", -0.01)
            _backward(ours, ddp, 10 + step, rank)
        if clip:  # after the edits: the norm is of the gradients stepped with
            a = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.05)
            b = torch.nn.utils.clip_grad_norm_(
                [p for p in ref.parameters() if p.grad is not None], 0.05)
            assert math.isclose(a.item(), b.item(), rel_tol=1e-5), (step, a, b)
        opt.step()
        ropt.step()
        if stage == 0 and step == 1 and not clip:  # stage 0 keeps gradients, as torch
            # (with clipping they are kept unclipped: docs/known-limits.md)
            _close(ours.fc1.weight.grad, ref.fc1.weight.grad, "p.grad after the step")
        opt.zero_grad()
        ropt.zero_grad()
        _same(ours, opt, ref, ropt, f"stage {stage} step {step}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grad_set_by_hand_is_stepped_with_as_ddp(stage, world, tmp_path):
    run_ranks(world, hand_set_case, stage, False, tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_grad_set_by_hand_then_clipped(stage, tmp_path):
    run_ranks(2, hand_set_case, stage, True, tmp_path=tmp_path)


# -- item 7: p.grad = None after backward ------------------------------------------------------
def drop_case(rank, world, stage, clip):
    ours, opt, ref, ddp, ropt = _pair(stage)
    for step in range(5):
        _backward(ours, ddp, step, rank)
        if step == 0:  # before the first step: the parameter gets no state at all
            _set((ours, ref), "norm.weight", None)
        if step in (1, 2):
            _set((ours, ref), "fc1.weight", None)
        if step == 3:  # dropped, then a further backward: only the new gradient counts
            _set((ours, ref), "fc2.weight", None)
            _backward(ours, ddp, 10 + step, rank)
        if clip:
            a = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.05)
            b = torch.nn.utils.clip_grad_norm_(
                [p for p in ref.parameters() if p.grad is not None], 0.05)
            assert math.isclose(a.item(), b.item(), rel_tol=1e-5), (step, a, b)
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        _same(ours, opt, ref, ropt, f"stage {stage} step {step}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grad_set_to_none_skips_the_parameter_as_adamw(stage, world, tmp_path):
    run_ranks(world, drop_case, stage, False, tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [1, 3])
def test_grad_set_to_none_then_clipped(stage, tmp_path):
    run_ranks(2, drop_case, stage, True, tmp_path=tmp_path)


# -- ranks that disagree, and edits after the reduction -----------------------------------------
def disagree_case(rank, world, stage, named):
    ours, opt, ref, ddp, ropt = _pair(stage, named=named)
    _backward(ours, ddp, 0, rank)
    opt.step()
    ropt.step()
    opt.zero_grad()
    ropt.zero_grad()
    want = "fc1.weight" if named or stage == 3 else r"parameter \d+, shape \(29, 13\)"
    for edit in ("none", "tensor", "mixed", "values", "one element"):
        _backward(ours, ddp, 1, rank)
        if edit == "values":  # every rank sets it, to its own value
            _set([ours], "fc1.weight", 0.02 + 0.01 * rank)
        elif edit == "one element":  # the same on every rank but one element of one rank
            _set([ours], "fc1.weight", 0.02)
            if rank == 1:
                ours.get_parameter("fc1.weight").grad[3, 5] += 1e-7
        elif rank == 0:  # the other ranks keep the averaged gradient, or do the other edit
            _set([ours], "fc1.weight", None if edit != "tensor" else 0.02)
        elif edit == "mixed":
            _set([ours], "fc1.weight", 0.02)
        before = zerokern.full_state_dict(ours, rank0_only=False)
        how = ("set p.grad by hand to different values" if edit in ("values", "one element")
               else "edited p.grad differently")
        with pytest.raises(RuntimeError, match=f"ranks {how}.*{want}"):
            opt.step()
        after = zerokern.full_state_dict(ours, rank0_only=False)
        assert all(torch.equal(before[k], after[k]) for k in before), "updated anyway"
        opt.zero_grad()  # training goes on after the gradients are dropped
        ropt.zero_grad()
    _backward(ours, ddp, 2, rank)
    opt.step()
    ropt.step()
    _same(ours, opt, ref, ropt, f"stage {stage} after the refusals")
    opt.zero_grad()
    ropt.zero_grad()
    # After clip_grad_norm_ the ranks cannot agree on an edit any more: refused.
    _backward(ours, ddp, 3, rank)
    opt.clip_grad_norm_(1.0)
    _set([ours], "fc1.weight", None)
    with pytest.raises(RuntimeError, match=f"p.grad of {want}.* was set to None after this "
                                           "step's gradients were reduced"):
        opt.step()
    opt.zero_grad()
    dist.barrier()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ranks_that_disagree_on_an_edit_are_refused_on_every_rank(stage, tmp_path):
    run_ranks(2, disagree_case, stage, stage == 1, tmp_path=tmp_path)


# -- item 8: add_param_group after gradients accumulated ----------------------------------------
def add_group_case(rank, world, stage, set_to_none):
    later = lambda m: [m.fc2.weight, m.fc2.bias]  # noqa: E731
    first = lambda m: [p for n, p in m.named_parameters()  # noqa: E731
                       if p.requires_grad and not n.startswith("fc2")]
    ours, opt, ref, ddp, ropt = _pair(stage, params=first)
    for step in range(3):
        # DDP averages fc2's gradients at every backward; opt.zero_grad() does not reach
        # them, so they accumulate (here: a local sum each rank holds, averaged at the step).
        _backward(ours, ddp, step, rank)
        opt.step()
        ropt.step()
        opt.zero_grad(set_to_none=set_to_none)
        ropt.zero_grad(set_to_none=set_to_none)
    opt.add_param_group(dict(params=later(ours), lr=1e-2))
    ropt.add_param_group(dict(params=later(ref), lr=1e-2))
    opt.step()  # fc2's accumulated gradient; the others: none, or kept zeros
    ropt.step()
    _same(ours, opt, ref, ropt, f"stage {stage} at add_param_group")
    for step in range(3, 5):
        opt.zero_grad(set_to_none=set_to_none)
        ropt.zero_grad(set_to_none=set_to_none)
        _backward(ours, ddp, step, rank)
        opt.step()
        ropt.step()
        _same(ours, opt, ref, ropt, f"stage {stage} step {step}")


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_add_param_group_uses_the_accumulated_gradient(stage, set_to_none, tmp_path):
    run_ranks(2, add_group_case, stage, set_to_none, tmp_path=tmp_path)


def test_add_param_group_on_three_ranks(tmp_path):
    run_ranks(3, add_group_case, 2, False, tmp_path=tmp_path)


# -- item 16: carried gradients at stages 2-3 ---------------------------------------------------
def carry_case(rank, world, stage):
    ours, opt, ref, ddp, ropt = _pair(stage)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # model.zero_grad() after each step: no warning
        for step in range(4):
            _backward(ours, ddp, step, rank)
            opt.step()
            ropt.step()
            if step == 1:  # the last step's gradient is gone: reading it is refused
                with pytest.raises(RuntimeError, match="gradient of the last step"):
                    ours.fc1.weight.grad.sum()
                with pytest.raises(RuntimeError, match="gradient of the last step"):
                    torch.linalg.vector_norm(ours.fc1.weight.grad)
            # set_to_none=False: zeros where a gradient exists, as torch (unused never decays)
            ours.zero_grad(set_to_none=step != 2)
            ref.zero_grad(set_to_none=step != 2)
            _same(ours, opt, ref, ropt, f"stage {stage} step {step}")
    # No zero_grad of any kind: torch would add the last step's gradient. Stages 2-3 warn,
    # stage 1 (which cannot add to its averaged slices) refuses.
    _backward(ours, ddp, 4, rank)
    opt.step()
    _backward(ours, ddp, 5, rank)
    if stage == 1:
        with pytest.raises(RuntimeError, match="no zero_grad"):
            opt.step()
        return
    with pytest.warns(UserWarning, match="no opt.zero_grad"):
        opt.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_zero_grad_after_step_is_not_warned(stage, tmp_path):
    run_ranks(2, carry_case, stage, tmp_path=tmp_path)


def test_fingerprint_tells_tensors_apart(monkeypatch):
    """The values check's hash: the same for the same bytes (however it is chunked), different
    for one flipped bit, another dtype or another shape of the same bytes."""
    from zerokern.zero import grad_edits

    torch.manual_seed(0)
    t = torch.randn(1000)
    fp = grad_edits.fingerprint(t)
    assert fp == grad_edits.fingerprint(t.clone())
    monkeypatch.setattr(grad_edits, "_FP_CHUNK", 7)
    assert fp == grad_edits.fingerprint(t)
    seen = {fp}
    for i in (0, 1, 500, 999):
        u = t.clone()
        u.view(torch.int32)[i] ^= 1  # one bit of one element
        seen.add(grad_edits.fingerprint(u))
    seen.add(grad_edits.fingerprint(t.view(40, 25)))
    seen.add(grad_edits.fingerprint(t.view(torch.int32)))
    seen.add(grad_edits.fingerprint(t.bfloat16()))
    seen.add(grad_edits.fingerprint(t[:999]))
    assert len(seen) == 9
