"""ZeroAdamW keeps torch.optim.Optimizer's surface (optimizer.py delegates to its parts): the
type, torch's step hooks, LR schedulers, zero_grad's two forms, add_param_group, and a
dropped optimizer that lets go of its parameters. One process at world size 1, against
torch.optim.AdamW(foreach=False) with ``backend="torch"`` (the same arithmetic), exactly."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import zerokern
from zerokern.zero.grad_guard import GradGuard

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _pair(stage, **kw):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4))
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = zerokern.ZeroAdamW(ours.parameters(), stage=stage, backend="torch", **HP, **kw)
    ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    return ours, opt, ref, ropt


def _loss(model, step):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
    return model(x).square().mean()


def _same(ours, ref):
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_is_a_torch_optimizer_with_its_step_hooks():
    ours, opt, _, _ = _pair(2)
    assert isinstance(opt, torch.optim.Optimizer)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o)))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", o)))
    _loss(ours, 0).backward()
    assert opt.step(lambda: 3.0) == 3.0  # closure's loss, as torch returns it
    assert seen == [("pre", opt), ("post", opt)]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_schedulers_and_zero_grad_forms(stage):
    ours, opt, ref, ropt = _pair(stage)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=2, gamma=0.5)
    for step in range(6):
        for m, o, s in ((ours, opt, sched), (ref, ropt, rsched)):
            _loss(m, step).backward()
            o.step()
            s.step()
            o.zero_grad(set_to_none=step % 2 == 0)  # zeros kept: every parameter decays
        assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"]
        _same(ours, ref)
    # A kept zero gradient is a plain zero tensor on every parameter (stages 0-1: a view).
    if stage < 2:
        assert all(p.grad is not None and not p.grad.any() for p in ours.parameters())


@pytest.mark.parametrize("stage", [0, 2])
def test_add_param_group_after_steps(stage):
    torch.manual_seed(0)
    base = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 2)})
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = zerokern.ZeroAdamW(ours["a"].parameters(), stage=stage, backend="torch", **HP)
    ropt = torch.optim.AdamW(ref["a"].parameters(), foreach=False, **HP)
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": list(ours["b"].parameters()), "lr": 3e-2})
            ropt.add_param_group({"params": list(ref["b"].parameters()), "lr": 3e-2})
        for m, o in ((ours, opt), (ref, ropt)):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            m["b"](torch.tanh(m["a"](x))).sum().backward()
            o.step()
            o.zero_grad()
    _same(ours, ref)
    assert [opt.shards_step(i) for i in range(4)] == [4, 4, 2, 2]


def test_p_grad_is_a_guard_between_backward_and_step():
    ours, opt, _, _ = _pair(2)
    _loss(ours, 0).backward()
    assert all(isinstance(p.grad, GradGuard) for p in ours.parameters())
    opt.step()
    # Stage 2 keeps no gradient after the step: a stale guard stands for it until the
    # gradients are cleared (or the next backward), refusing reads.
    assert all(isinstance(p.grad, GradGuard) for p in ours.parameters())
    with pytest.raises(RuntimeError, match="gradient of the last step"):
        ours[0].weight.grad.sum()
    opt.zero_grad()
    assert all(p.grad is None for p in ours.parameters())


def test_a_dropped_optimizer_leaves_no_stale_guard_in_the_way():
    ours, opt, _, _ = _pair(2)
    _loss(ours, 0).backward()
    opt.step()  # no zero_grad: stale guards stay on p.grad
    del opt
    gc.collect()
    topt = torch.optim.AdamW(ours.parameters(), foreach=False, **HP)
    _loss(ours, 1).backward()  # they come off before autograd adds to p.grad
    assert all(type(p.grad) is torch.Tensor for p in ours.parameters())
    topt.step()


def test_a_dropped_optimizer_lets_go():
    ours, opt, ref, ropt = _pair(1)
    _loss(ours, 0).backward()
    opt.step()
    opt.zero_grad()
    alive = weakref.ref(opt)
    del opt
    gc.collect()
    assert alive() is None
    # Its hooks are inert: torch's AdamW trains the model as it trains the reference.
    topt = torch.optim.AdamW(ours.parameters(), foreach=False, **HP)
    ref.load_state_dict(ours.state_dict())
    ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    for step in range(2):
        for m, o in ((ours, topt), (ref, ropt)):
            _loss(m, step).backward()
            assert all(type(p.grad) is torch.Tensor for p in m.parameters())
            o.step()
            o.zero_grad()
    _same(ours, ref)
