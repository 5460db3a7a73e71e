"""A run resumed from ``full_state_dict`` (nanoGPT's checkpoint: model state dict + optimizer
state dict in torch's format, then ``load_state_dict`` on a fresh model and optimizer) goes on
bit for bit as the uninterrupted run, as DDP + torch.optim.AdamW resumes, with clipping that
binds: the resumed optimizer lays its buffers out in the saved gradient order, so the clipping
norm is summed as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from models import TinyGPT, batch

import zerokern


def _groups(model):
    # nanoGPT's groups: the first backward's order is then not reverse registration
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]


def _build(stage):
    torch.manual_seed(0)
    model = TinyGPT(dim=48, hidden=96)  # tied head: the order differs from registration's
    # small buckets: many parameters straddle the shards, so the layout shows in the norm
    opt = zerokern.ZeroAdamW(_groups(model), lr=1e-2, betas=(0.9, 0.95), stage=stage,
                             bucket_numel=500)
    return model, opt


def _train(model, opt, rank, steps):
    for step in steps:
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # binds at every step
        opt.step()
        opt.zero_grad(set_to_none=True)


def resume_case(rank, world):
    for stage in (1, 2):
        _resume(rank, stage)


def _resume(rank, stage):
    model, opt = _build(stage)
    _train(model, opt, rank, range(3))
    ck_model = {k: v.clone() for k, v in model.state_dict().items()}
    ck_opt = opt.full_state_dict(rank0_only=False)
    _train(model, opt, rank, range(3, 8))

    model2, opt2 = _build(stage)
    model2.load_state_dict(ck_model)
    with pytest.raises(ValueError, match="grad_order"):
        opt2.load_state_dict({**ck_opt, "grad_order": "reverse"})
    # stage 2 reads the order as a tensor, as a pipeline that converted the list may give it
    order = ck_opt["grad_order"]
    opt2.load_state_dict(ck_opt if stage == 1 else {**ck_opt, "grad_order": torch.tensor(order)})
    _train(model2, opt2, rank, range(3, 8))
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), (stage, name, (a - b).abs().max().item())
    # torch's AdamW still takes the dict (it ignores the extra key)
    torch.optim.AdamW(_groups(TinyGPT(dim=48, hidden=96))).load_state_dict(ck_opt)


def test_full_state_dict_resume_is_bitwise(tmp_path):
    run_ranks(2, resume_case, tmp_path=tmp_path)
