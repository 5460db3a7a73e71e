"""The p.grad guards of one optimizer (zerokern/zero/guard_set.py), in one process and without
an optimizer: a GuardSet over plain parameters whose ``measure`` stands for the step's
reduction. torch's own clip_grad_norm_ runs on the guards and must give what it gives on
plain gradients with the same norms."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from torch import nn

from zerokern.zero.grad_guard import GradGuard
from zerokern.zero.guard_set import GuardSet


class Measure:
    """The reduction's answer: squared norms and clip / loss scale; counts its calls."""

    def __init__(self, sq, scale=1.0):
        self.sq, self.scale, self.calls = sq, scale, 0

    def __call__(self):
        self.calls += 1
        return self.sq, self.scale


def _setup(sq=(9.0, 16.0), scale=1.0):
    ps = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))]
    m = Measure(list(sq), scale)
    gs = GuardSet(ps, m)
    gs.watch(ps)
    return ps, gs, m


def test_install_lift_and_relay():
    ps, gs, _ = _setup()
    real = torch.ones(2, 3)
    ps[0].grad = real
    gs.install()
    assert gs.on and all(isinstance(p.grad, GradGuard) for p in ps)
    assert ps[0].grad.zk_held is real and ps[1].grad.zk_held is None
    assert ps[0].grad.shape == (2, 3) and ps[0].grad.dtype == torch.float32
    with gs.lifted():
        assert ps[0].grad is real and ps[1].grad is None and not gs.on
    assert gs.on and isinstance(ps[0].grad, GradGuard)
    with gs.lifted(relay=False):  # the step ends them: not put back
        pass
    assert not gs.on and ps[0].grad is real
    gs.install()
    with pytest.raises(ValueError), gs.lifted(relay=False):
        raise ValueError  # an error leaves p.grad as it was: guarded
    assert gs.on and isinstance(ps[0].grad, GradGuard)
    gs.discard()
    assert not gs.on and ps[0].grad is real and ps[0].grad is not None


def test_torchs_clip_grad_norm_on_guards_is_torchs_on_plain_gradients():
    ps, gs, m = _setup(sq=(9.0, 16.0), scale=1.0)
    gs.install()
    total = torch.nn.utils.clip_grad_norm_(ps, 1.0)
    # The same norms on plain gradients, clipped by torch.
    ref = [nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))]
    ref[0].grad, ref[1].grad = torch.tensor([3.0]), torch.tensor([4.0])
    rtotal = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert torch.equal(total, rtotal)
    coef = gs.coef()
    assert torch.equal(torch.tensor([3.0]) * coef, ref[0].grad)
    assert torch.equal(torch.tensor([4.0]) * coef, ref[1].grad)
    assert m.calls == 1  # one reduction, however many norms torch asks for
    torch.linalg.vector_norm(ps[0].grad)
    assert m.calls == 1
    # The norm read after the clip is the clipped one, as torch's would be.
    assert torch.linalg.vector_norm(ps[1].grad).item() == pytest.approx(4.0 * coef, rel=0,
                                                                          abs=1e-6)


def test_norms_scale_and_cache():
    _, gs, m = _setup(sq=(4.0, 0.0), scale=0.5)
    assert gs.norms() == [math.sqrt(4.0) * 0.5, 0.0]
    assert gs.norms() is gs.norms() and m.calls == 1
    gs.discard()  # the step is over: the next read asks again
    gs.norms()
    assert m.calls == 2


def test_one_factor_for_all_or_refused():
    ps, gs, _ = _setup()
    gs.install()
    assert gs.coef() == 1.0
    ps[0].grad.mul_(0.5)
    with pytest.raises(RuntimeError, match="different factors"):
        gs.coef()
    ps[1].grad.mul_(0.5)
    assert gs.coef() == 0.5
    for p in ps:
        p.grad.mul_(math.nan)
    assert math.isnan(gs.coef())
    gs.discard()
    gs.install()
    torch._foreach_zero_([p.grad for p in ps])
    assert gs.coef() == 0.0
    with pytest.raises(RuntimeError, match="clip_grad_norm_"):
        ps[0].grad.clamp_(-1, 1)  # clip_grad_value_ and any other op: refused


def _backward(ps):
    (ps[0].sum() + ps[1].sum()).backward()


def test_a_new_backward_lifts_them_or_is_refused_after_a_clip():
    ps, gs, _ = _setup()
    _backward(ps)
    gs.install()
    _backward(ps)  # the hook before accumulation put the real .grad back: it accumulates
    assert not gs.on and not isinstance(ps[0].grad, GradGuard)
    assert torch.equal(ps[0].grad, torch.full((2, 3), 2.0))
    assert torch.equal(ps[1].grad, torch.full((4,), 2.0))
    gs.install()
    ps[0].grad.mul_(0.5)
    ps[1].grad.mul_(0.5)
    with pytest.raises(RuntimeError, match="another backward started"):
        _backward(ps)


def test_armed_once_per_backward():
    ps, gs, _ = _setup()
    installs = []

    def install():
        installs.append(1)
        gs.install()

    for p in ps:
        p.register_post_accumulate_grad_hook(lambda _p: gs.arm(install))
    _backward(ps)
    assert installs == [1] and gs.on and isinstance(ps[0].grad, GradGuard)
    _backward(ps)  # a new backward: armed again, once
    assert installs == [1, 1]


def test_hooks_hold_the_set_weakly():
    ps, gs, _ = _setup()
    gs.install()
    guard = ps[0].grad
    del gs
    gc.collect()
    with pytest.raises(RuntimeError, match="deleted"):
        torch.linalg.vector_norm(guard)
    for p in ps:
        p.grad = None
    _backward(ps)  # the hooks of a dropped set do nothing
    assert torch.equal(ps[0].grad, torch.ones(2, 3))
