"""One global norm over two zerokern optimizers on disjoint parameters of one model (issue 37,
item 8): ``clip_grad_norm_(model.parameters(), c)`` clips by the norm over all of them, as DDP
+ two torch optimizers does, in every form torch offers (patched, imported before zerokern,
filtered lists, ``get_total_norm`` + ``clip_grads_with_norm_``). A list that covers only part
of one optimizer's parameters is refused (torch would clip those gradients alone). Stages
0-3: at stage 3 both optimizers train one model sharded by shard_model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from _tol import TRAIN_FP32
from dist_utils import run_ranks
from models import OddNet, batch
from test_clip_forms import FORMS, MAX_NORM, TORCH_CLIP
from torch.nn.parallel import DistributedDataParallel as DDP

import zerokern

SGD_HP = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
ADAMW_HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)


def _split(model):
    """Torch's Muon recipe, with SGD standing in for Muon: matrices to one optimizer, the
    rest (embedding too) to the other."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    mats = [p for n, p in trained if p.dim() == 2 and not n.startswith("emb")]
    rest = [p for n, p in trained if not (p.dim() == 2 and not n.startswith("emb"))]
    return mats, rest


def _build(stage):
    torch.manual_seed(0)
    base = OddNet()
    ours = copy.deepcopy(base)
    if stage == 3:
        ours = zerokern.shard_model(ours)
    mats, rest = _split(ours)
    opts = [zerokern.ZeroOptimizer(mats, torch.optim.SGD, stage=stage, bucket_numel=61,
                                   **SGD_HP),
            zerokern.ZeroAdamW(rest, stage=stage, bucket_numel=61, **ADAMW_HP)]
    ref = copy.deepcopy(base)
    ddp = DDP(ref, find_unused_parameters=True)
    rmats, rrest = _split(ref)
    ropts = [torch.optim.SGD(rmats, foreach=False, **SGD_HP),
             torch.optim.AdamW(rrest, foreach=False, **ADAMW_HP)]
    return ours, opts, ref, ddp, ropts


def _same_params(ours, ref, what):
    full = zerokern.full_state_dict(ours, rank0_only=False)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1],
                                   msg=lambda m, n=n: f"{what} {n}: {m}")


def _one_stage(rank, stage, form, steps=3):
    clip = FORMS[form]
    ours, opts, ref, ddp, ropts = _build(stage)
    for step in range(steps):
        x, y = batch(step, rank)
        F.cross_entropy(ours(x, use_sometimes=step % 2 == 0), y).backward()
        F.cross_entropy(ddp(x, use_sometimes=step % 2 == 0), y).backward()
        n_ours = clip(list(ours.parameters()), ours)
        n_ref = clip(list(ref.parameters()), ref)
        assert float(n_ref) > MAX_NORM  # the clip fires
        assert math.isclose(float(n_ours), float(n_ref), rel_tol=1e-5), \
            (stage, form, step, n_ours, n_ref)
        for o in opts + ropts:
            o.step()
            o.zero_grad()
    _same_params(ours, ref, f"two optimizers, {form}, stage {stage}")


def two_opts_case(rank, world, stages, forms):
    # Stage 3 too: one sharded model, both optimizers' gradients reduced by its backward,
    # each norm over its own pieces (stage3/owners.py).
    for stage in stages:
        for form in forms:
            _one_stage(rank, stage, form)


def test_clip_over_two_optimizers_matches_ddp(tmp_path):
    run_ranks(2, two_opts_case, [0, 1, 2, 3], list(FORMS), tmp_path=tmp_path)


def subset_case(rank, world, stage):
    """Part of one optimizer's parameters: refused before anything changes (zerokern clips an
    optimizer's gradients by one coefficient, torch would clip the listed ones alone), by the
    patched call at once, by torch's own (imported before zerokern) at that optimizer's
    step(); the whole of one optimizer is fine (its own norm, as torch clips the listed
    gradients by theirs) and training goes on as DDP's."""
    ours, opts, ref, ddp, ropts = _build(stage)
    mats, rest = _split(ours)
    rmats, _ = _split(ref)
    x, y = batch(0, rank)
    F.cross_entropy(ours(x), y).backward()
    before = zerokern.full_state_dict(ours, rank0_only=False)
    with pytest.raises(ValueError, match="part of the parameters"):
        torch.nn.utils.clip_grad_norm_(mats + rest[:1], MAX_NORM)
    TORCH_CLIP(mats + rest[:1], MAX_NORM)
    with pytest.raises(RuntimeError, match="different factors"):
        opts[1].step()
    after = zerokern.full_state_dict(ours, rank0_only=False)
    assert all(torch.equal(before[k], after[k]) for k in before)
    for o in opts:
        o.zero_grad()  # the batch is dropped, as torch's skip pattern drops it

    for step in range(1, 3):
        x, y = batch(step, rank)
        F.cross_entropy(ours(x), y).backward()
        F.cross_entropy(ddp(x), y).backward()
        n_ours = torch.nn.utils.clip_grad_norm_(mats, MAX_NORM)
        n_ref = torch.nn.utils.clip_grad_norm_(rmats, MAX_NORM)
        assert float(n_ref) > MAX_NORM
        assert math.isclose(float(n_ours), float(n_ref), rel_tol=1e-5)
        for o in opts + ropts:
            o.step()
            o.zero_grad()
    _same_params(ours, ref, f"one optimizer's parameters, stage {stage}")


def test_clip_over_part_of_one_optimizer_is_refused(tmp_path):
    run_ranks(2, subset_case, 1, tmp_path=tmp_path)
