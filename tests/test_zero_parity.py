"""ZeroAdamW stages 0-2 against DDP-style averaging + torch.optim.AdamW on CPU ranks (gloo).

Each scenario runs our optimizer and an independent reference in the same processes on the
same data: the reference averages gradients with torch.distributed (or real DDP) and steps
torch.optim.AdamW(foreach=False); for bf16 it keeps an fp32 master and casts back.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tol import TRAIN_FP32
from dist_utils import run_ranks
from models import IntGradNet, OddNet, batch

import zerokern

STEPS = 10


def _ref_average(model: torch.nn.Module, world: int) -> None:
    """DDP semantics: average each gradient over ranks; globally unused ones stay None."""
    params = [p for p in model.parameters() if p.requires_grad]
    flags = torch.tensor([0.0 if p.grad is None else 1.0 for p in params])
    dist.all_reduce(flags)
    for p, f in zip(params, flags.tolist()):
        if f == 0:
            p.grad = None
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world)


def _groups(model, two_groups: bool, lr: float):
    if not two_groups:
        return [p for p in model.parameters()]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [dict(params=decay, weight_decay=0.1), dict(params=other, weight_decay=0.0, lr=lr * 2)]


def scenario(rank, world, *, stage, dtype=torch.float32, bucket_numel=61, two_groups=False,
             sched=False, accum=1, no_sync=True, clip=None, sometimes=False, ddp=False,
             intgrad=False):
    torch.manual_seed(0)
    base = IntGradNet() if intgrad else OddNet()
    ours = copy.deepcopy(base).to(dtype)
    ref = copy.deepcopy(base).to(dtype)
    lr = 3e-3
    opt = zerokern.ZeroAdamW(_groups(ours, two_groups, lr), lr=lr, betas=(0.9, 0.95),
                             weight_decay=0.05, stage=stage, bucket_numel=bucket_numel,
                             max_grad_norm=clip)
    lowp = dtype != torch.float32
    masters = None
    if lowp:  # the reference keeps its own fp32 master, as mixed-precision training does
        masters = {p: p.detach().float().clone().requires_grad_(p.requires_grad)
                   for p in ref.parameters()}
        ref_params = _groups_like(ref, masters, two_groups, lr)
    else:
        ref_params = _groups(ref, two_groups, lr)
    ropt = torch.optim.AdamW(ref_params, lr=lr, betas=(0.9, 0.95), weight_decay=0.05,
                             foreach=False)
    ref_model = (torch.nn.parallel.DistributedDataParallel(ref, find_unused_parameters=True)
                 if ddp else ref)
    scheds = []
    if sched:
        f = lambda s: 1.0 / (1 + 0.5 * s)
        scheds = [torch.optim.lr_scheduler.LambdaLR(opt, f),
                  torch.optim.lr_scheduler.LambdaLR(ropt, f)]
    for step in range(STEPS):
        use = (step % 2 == 0) if sometimes else True
        for mb in range(accum):
            x, y = batch(step * accum + mb, rank)
            last = mb == accum - 1
            ctx = opt.no_sync() if (not last and no_sync) else _null()
            with ctx:
                loss = _loss(ours, x, y, use, intgrad, step * accum + mb, rank) / accum
                loss.backward()
            loss_r = _loss(ref_model, x, y, use, intgrad, step * accum + mb, rank) / accum
            loss_r.backward()
        if not ddp:
            _ref_average(ref, world)
        if lowp:
            for p, m in masters.items():
                m.grad = None if p.grad is None else p.grad.float()
        rparams = list(masters.values()) if lowp else list(ref.parameters())
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for p in rparams if p.grad is not None], clip)
        opt.step()
        ropt.step()
        if clip is not None:
            assert math.isclose(opt.last_grad_norm, norm.item(), rel_tol=1e-4), \
                (opt.last_grad_norm, norm.item())
        if lowp:
            with torch.no_grad():
                for p, m in masters.items():
                    p.copy_(m)
        opt.zero_grad()
        ropt.zero_grad()
        ref.zero_grad(set_to_none=True)
        for s in scheds:
            s.step()
        for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
            if lowp:
                _within_one_ulp(a.detach(), b.detach(), f"{name} step {step}")
            else:
                torch.testing.assert_close(a, b, rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1],
                                           msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")
    unused = (lambda m: m.unused) if intgrad else (lambda m: m.unused.weight)
    assert torch.equal(unused(ours), unused(base).to(dtype)), "unused param moved"
    assert torch.equal(ours.frozen, base.frozen.to(dtype))


def _loss(model, x, y, use, intgrad, step, rank):
    if intgrad:
        return model(step, rank, use)
    return F.cross_entropy(model(x, use).float(), y)


def _groups_like(ref, masters, two_groups, lr):
    if not two_groups:
        return [masters[p] for p in ref.parameters()]
    decay = [masters[p] for p in ref.parameters() if p.dim() >= 2]
    other = [masters[p] for p in ref.parameters() if p.dim() < 2]
    return [dict(params=decay, weight_decay=0.1), dict(params=other, weight_decay=0.0, lr=lr * 2)]


def _within_one_ulp(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    ia = a.view(torch.int16).int()
    ib = b.view(torch.int16).int()
    # Same sign: adjacent bf16 values differ by one in their bit pattern.
    diff = (ia - ib).abs()
    ok = (diff <= 1) | (a == b)
    assert bool(ok.all()), f"{what}: {int((~ok).sum())} elements differ by more than 1 ulp"


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _run(world, tmp_path, **kw):
    run_ranks(world, _scenario_entry, kw, tmp_path=tmp_path)


def _scenario_entry(rank, world, kw):
    scenario(rank, world, **kw)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp32_matches_adamw(world, stage, tmp_path):
    _run(world, tmp_path, stage=stage, two_groups=True, sched=True, sometimes=True)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_accumulation_and_clipping(world, stage, tmp_path):
    _run(world, tmp_path, stage=stage, accum=3, clip=0.05)


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_without_no_sync(stage, tmp_path):
    _run(2, tmp_path, stage=stage, accum=2, no_sync=False)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_within_one_ulp_of_fp32_master_reference(world, stage, tmp_path):
    _run(world, tmp_path, stage=stage, dtype=torch.bfloat16, bucket_numel=100, intgrad=True,
         two_groups=True, sometimes=True, accum=2)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_against_real_ddp(stage, tmp_path):
    _run(2, tmp_path, stage=stage, ddp=True, accum=2)
