"""Clipping however a script calls it: every form either equals DDP + torch AdamW with the same
clipping, or raises on every rank before the step, naming opt.clip_grad_norm_. Between a
synchronised backward and step(), p.grad holds a GradGuard (zerokern/zero/grad_guard.py), on
which torch's own utilities compute the global norm or are refused."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from _tol import TRAIN_FP32
from dist_utils import run_ranks
from models import OddNet, batch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

import zerokern
from zerokern.zero import interop

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
MAX_NORM = 0.05  # below every step's norm: clipping fires on every step (asserted)
# torch's clip_grad_norm_ as a script that imported it before zerokern holds it: the patch
# zerokern installs at import never reaches that name.
TORCH_CLIP = interop._TORCH_CLIP


def _clip_early_import(params, model):
    return TORCH_CLIP(params, MAX_NORM)


def _clip_early_import_foreach(params, model):
    return TORCH_CLIP(params, MAX_NORM, foreach=True)


def _clip_fairseq(params, model):
    # fairseq's habit: only the parameters that have a gradient
    return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                          MAX_NORM)


def _clip_fairseq_early_import(params, model):
    return TORCH_CLIP([p for p in model.parameters() if p.grad is not None], MAX_NORM)


def _clip_total_norm_then_scale(params, model):
    # torch >= 2.6's two-step form
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = get_total_norm(grads, 2.0)
    clip_grads_with_norm_(list(model.parameters()), MAX_NORM, total)
    return total


def _clip_patched(params, model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


FORMS = {f.__name__[6:]: f for f in (
    _clip_early_import, _clip_early_import_foreach, _clip_fairseq, _clip_fairseq_early_import,
    _clip_total_norm_then_scale, _clip_patched)}


def _build(stage, offload=False):
    torch.manual_seed(0)
    base = OddNet()
    ours = copy.deepcopy(base)
    if stage == 3:
        ours = zerokern.shard_model(ours, offload_params=offload)
    kw = dict(offload="cpu") if offload else {}
    opt = zerokern.ZeroAdamW(ours.parameters(), stage=stage, bucket_numel=61, **HP, **kw)
    ref = copy.deepcopy(base)
    ddp = DDP(ref, find_unused_parameters=True)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], foreach=False,
                             **HP)
    return ours, opt, ref, ddp, ropt


def _same_params(ours, ref, what):
    full = zerokern.full_state_dict(ours, rank0_only=False)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1],
                                   msg=lambda m, n=n: f"{what} {n}: {m}")


def form_case(rank, world, stage, form, offload=False, steps=4):
    clip = FORMS[form]
    ours, opt, ref, ddp, ropt = _build(stage, offload)
    fired = 0
    for step in range(steps):
        x, y = batch(step, rank)
        F.cross_entropy(ours(x, use_sometimes=step % 2 == 0), y).backward()
        F.cross_entropy(ddp(x, use_sometimes=step % 2 == 0), y).backward()
        n_ours = clip(list(ours.parameters()), ours)
        n_ref = clip(list(ref.parameters()), ref)
        assert math.isclose(float(n_ours), float(n_ref), rel_tol=1e-5), (step, n_ours, n_ref)
        fired += float(n_ref) > MAX_NORM
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    assert fired == steps
    _same_params(ours, ref, f"{form} stage {stage}")


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_form_matches_ddp(stage, form, tmp_path):
    run_ranks(2, form_case, stage, form, tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [2, 3])
def test_clip_form_matches_ddp_with_offload(stage, tmp_path):
    run_ranks(2, form_case, stage, "early_import", True, tmp_path=tmp_path)


def refused_case(rank, world, stage):
    """clip_grad_value_, and torch ops that read a gradient's values: refused on every rank,
    naming opt.clip_grad_norm_ (torch's GradScaler: naming loss_scale); nothing changed;
    opt.zero_grad() drops the step and training goes on."""
    ours, opt, ref, ddp, ropt = _build(stage)
    x, y = batch(0, rank)
    F.cross_entropy(ours(x), y).backward()
    before = {k: v.clone() for k, v in zerokern.full_state_dict(ours, rank0_only=False).items()}
    with pytest.raises(RuntimeError, match=r"opt\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_value_(ours.parameters(), 0.01)
    with pytest.raises(RuntimeError, match=r"opt\.clip_grad_norm_"):
        ours.fc1.weight.grad.abs().max()
    with pytest.raises(RuntimeError, match=r"opt\.clip_grad_norm_"):  # a clip by inf-norm
        TORCH_CLIP(ours.parameters(), 1.0, norm_type=math.inf)
    # torch's GradScaler (nanoGPT's fp16 path: scaler.unscale_(opt) before clipping, or
    # scaler.step(opt)) unscales the gradients in place: refused, naming ZeroAdamW's own
    # loss scaling rather than clipping
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # sets the scale, as scaler.scale(loss) does
    with pytest.raises(RuntimeError, match=r"GradScaler.*loss_scale=.dynamic.*opt\.scale_loss"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"GradScaler.*loss_scale=.dynamic.*opt\.scale_loss"):
        scaler.step(opt)
    # a clip over some parameters only scales them by another factor than the rest
    TORCH_CLIP([ours.fc1.weight, ours.fc2.weight], 1e-4)
    with pytest.raises(RuntimeError, match=r"opt\.clip_grad_norm_"):
        opt.step()
    after = zerokern.full_state_dict(ours, rank0_only=False)
    assert all(torch.equal(before[k], after[k]) for k in before)
    opt.zero_grad()
    for step in range(1, 3):  # both train on from here, as from a dropped batch
        x, y = batch(step, rank)
        F.cross_entropy(ours(x), y).backward()
        F.cross_entropy(ddp(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ours.parameters(), MAX_NORM)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    _same_params(ours, ref, f"after refusals, stage {stage}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_value_clipping_and_reads_are_refused(stage, tmp_path):
    run_ranks(2, refused_case, stage, tmp_path=tmp_path)


def skip_case(rank, world, stage, form, offload=False):
    """torch's pattern: clip, see a non-finite norm, zero_grad() and skip the batch. Step 1's
    loss is made infinite on every rank; both skip it and train on identically."""
    clip = FORMS[form]
    ours, opt, ref, ddp, ropt = _build(stage, offload)
    skipped = 0
    for step in range(4):
        x, y = batch(step, rank)
        k = math.inf if step == 1 else 1.0
        (F.cross_entropy(ours(x), y) * k).backward()
        (F.cross_entropy(ddp(x), y) * k).backward()
        n_ours, n_ref = clip(list(ours.parameters()), ours), clip(list(ref.parameters()), ref)
        assert math.isfinite(float(n_ours)) == math.isfinite(float(n_ref))
        if not math.isfinite(float(n_ref)):
            skipped += 1
            opt.zero_grad()
            ropt.zero_grad()
            continue
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    assert skipped == 1
    _same_params(ours, ref, f"skip pattern ({form}), stage {stage}")


@pytest.mark.parametrize("form", ["patched", "early_import"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nonfinite_norm_skip_batch_pattern(stage, form, tmp_path):
    run_ranks(2, skip_case, stage, form, tmp_path=tmp_path)


def test_nonfinite_skip_with_offload(tmp_path):
    run_ranks(2, skip_case, 2, "early_import", True, tmp_path=tmp_path)


def test_opt_method_then_skip_single_process():
    """The same pattern with opt.clip_grad_norm_ and no process group (world size 1)."""
    torch.manual_seed(0)
    model = OddNet()
    ref = copy.deepcopy(model)
    opt = zerokern.ZeroAdamW(model.parameters(), stage=2, **HP)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], foreach=False,
                             **HP)
    for step in range(3):
        x, y = batch(step, 0)
        k = math.inf if step == 1 else 1.0
        (F.cross_entropy(model(x), y) * k).backward()
        (F.cross_entropy(ref(x), y) * k).backward()
        a = opt.clip_grad_norm_(MAX_NORM)
        b = TORCH_CLIP(ref.parameters(), MAX_NORM)
        if not math.isfinite(float(b)):
            assert not math.isfinite(float(a))
            opt.zero_grad()
            ropt.zero_grad()
            continue
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1], msg=n)


def rank0_logging_case(rank, world, stage):
    """Per-parameter gradient norms logged on rank 0 only (a common wandb habit), then the
    step: the norms equal DDP's and no collective is mismatched (they travel with the step's
    own all-reduce, which the other ranks make at step())."""
    ours, opt, ref, ddp, ropt = _build(stage)
    for step in range(3):
        x, y = batch(step, rank)
        F.cross_entropy(ours(x), y).backward()
        F.cross_entropy(ddp(x), y).backward()
        if rank == 0:
            for (n, p), r in zip(ours.named_parameters(), ref.parameters()):
                if r.grad is not None:
                    assert math.isclose(float(p.grad.norm()), float(r.grad.norm()),
                                        rel_tol=1e-5, abs_tol=1e-7), (step, n)
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    _same_params(ours, ref, f"rank-0 logging, stage {stage}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grad_norms_read_on_rank0_only(stage, tmp_path):
    run_ranks(2, rank0_logging_case, stage, tmp_path=tmp_path)


class _Boom(torch.autograd.Function):
    """Raises in backward, after the model's other gradients were accumulated (created
    before the forward, so the engine runs it last)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom")


def raised_backward_case(rank, world, stage):
    """A backward that raises (caught, the batch dropped with zero_grad(), as an OOM-skip loop
    does) must not switch the guards off for the rest of the run: torch's clip imported
    before zerokern still equals DDP's afterwards, and Lightning's grad_norm (p.grad.data)
    reads the same per-parameter norms as under DDP."""
    from pytorch_lightning.utilities import grad_norm
    from test_zero_parity import _ref_average

    ours, opt, ref, _, ropt = _build(stage)  # the reference: averaged by hand (DDP cannot
    w = _Boom.apply(ours.fc1.weight)          # go on after a backward that raised)
    x, y = batch(0, rank)
    with pytest.raises(RuntimeError, match="boom"):
        (F.cross_entropy(ours(x), y) + 0.0 * w.sum()).backward()
    opt.zero_grad()
    for step in range(1, 4):
        x, y = batch(step, rank)
        F.cross_entropy(ours(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        _ref_average(ref, world)
        a, b = grad_norm(ours, 2), grad_norm(ref, 2)
        # A parameter no rank gave a gradient has a guard too (norm 0); torch's is None.
        assert b.keys() <= a.keys()
        for k in a:
            want = float(b[k]) if k in b else 0.0
            assert math.isclose(float(a[k]), want, rel_tol=1e-5, abs_tol=1e-7), k
        n_ours = TORCH_CLIP(list(ours.parameters()), MAX_NORM)
        n_ref = TORCH_CLIP(list(ref.parameters()), MAX_NORM)
        assert math.isclose(float(n_ours), float(n_ref), rel_tol=1e-5), (step, n_ours, n_ref)
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    _same_params(ours, ref, f"after a raised backward, stage {stage}")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_guards_survive_a_backward_that_raised(stage, tmp_path):
    run_ranks(2, raised_backward_case, stage, tmp_path=tmp_path)
