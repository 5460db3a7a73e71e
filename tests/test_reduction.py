"""The step's gradient reduction (zerokern/zero/reduction.py), in one process: the flags and
per-parameter squares of the one all-reduce (a fake two-rank comm adds the other rank's
part), the norm and clip arithmetic against float64 references, the record shared by
clip_grad_norm_ and step(), and the refusals between steps. Integer-valued gradients with
one non-zero element per parameter make every fp32 norm exact."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import zerokern
from zerokern.zero.grad_edits import DROPPED, SET, GradEdits, fingerprint
from zerokern.zero.reduction import GradReduction, Reduced, grad_scale


class FakeComm:
    """all_reduce adds ``other`` (what the other rank contributes) in place."""

    world_size, rank = 2, 0
    replicate = None  # a flat group

    def __init__(self, other, other_fingerprints=None):
        self.other = other
        # The other rank's fingerprints of the gradients set by hand (None: the same as this
        # rank's): the values check is a MAX all-reduce of them and of their negations.
        self.other_fingerprints = other_fingerprints
        self.calls = 0

    def all_reduce(self, t, what, count=True, op=None):
        self.calls += 1
        if op is None:
            t.add_(self.other.to(t.dtype))
        elif self.other_fingerprints is not None:
            fp = torch.tensor(self.other_fingerprints, dtype=t.dtype)
            torch.maximum(t, torch.cat([fp, -fp]), out=t)


class FakeEngine:
    def __init__(self, got, replicated=False, sq=0.0, carried=False):
        self.got, self.replicated_grads, self.sq = got, replicated, sq
        self.reducer = type("R", (), {"carried": carried})()

    def finish_grads(self):
        return list(self.got)

    def grad_sq_norm(self):
        return self.sq


def test_flags_and_squares_of_both_ranks():
    mine = torch.tensor([9.0, 0.0, 16.0])  # this rank's partial squares
    other = torch.tensor([25.0, 0.0, 1.0, 0.0,  # its total, then its flags
                          16.0, 0.0, 9.0])  # and its squares
    comm = FakeComm(other)
    red = GradReduction(comm).reduce(FakeEngine([True, False, True]), events=3,
                                     need_norm=True, loss_scale=4.0,
                                     device=torch.device("cpu"), partials=lambda: mine)
    assert comm.calls == 1
    assert red.active == [True, True, True]
    assert red.param_sq == [25.0, 0.0, 25.0]
    assert red.sq_norm == 50.0 and red.norm == math.sqrt(50.0) / 4.0
    assert red.has_norm and red.clip == 1.0 and red.events == 3


def test_no_norm_asked_and_a_parameter_without_gradient_anywhere():
    comm = FakeComm(torch.zeros(5))
    red = GradReduction(comm).reduce(FakeEngine([False, True]), events=1, need_norm=False,
                                     loss_scale=1.0, device=torch.device("cpu"),
                                     partials=lambda: torch.tensor([0.0, 4.0]))
    assert red.active == [False, True] and red.sq_norm == 0.0 and red.norm == 0.0
    assert not red.has_norm and red.param_sq == [0.0, 4.0]


def test_replicated_gradients_take_the_engines_norm():
    # Stage 0: every rank holds the averaged gradient; no squares travel.
    comm = FakeComm(torch.tensor([0.0, 0.0, 1.0]))
    red = GradReduction(comm).reduce(FakeEngine([True, False], replicated=True, sq=36.0),
                                     events=1, need_norm=True, loss_scale=1.0,
                                     device=torch.device("cpu"),
                                     partials=lambda: pytest.fail("no partials at stage 0"))
    assert red.active == [True, True] and red.param_sq is None and red.norm == 6.0


def test_kept_zeros_and_edits_join_the_flags():
    # zero_grad(set_to_none=False) keeps a zero where a gradient existed (parameter 0, not
    # 1, as torch); parameter 2's gradient was set by hand on both ranks, parameter 3's
    # dropped on both: the counts travel after the flags, the squares after them.
    edits = GradEdits(4)
    edits.end_step([True, False, False, False])
    edits.zero_grad(False, {}, [], [False] * 4, None)
    edits.kind[2], edits.kind[3] = SET, DROPPED
    edits.values[2] = torch.full((3,), 0.5)
    other = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0,
                          0.0, 0.0, 0.0, 0.0])
    r = GradReduction(FakeComm(other))
    red = r.reduce(FakeEngine([False, False, False, False]), events=0, need_norm=False,
                   loss_scale=1.0, device=torch.device("cpu"), partials=lambda: torch.zeros(4),
                   edits=edits, layout=type("L", (), {"pieces": ()})())
    assert red.active == [True, False, True, False] and red.param_sq == [0.0] * 4
    # Both ranks set parameter 2's gradient, the other rank to other values: refused.
    with pytest.raises(RuntimeError, match=r"set p.grad by hand to different values after "
                                           r"backward \(param 2\)"):
        GradReduction(FakeComm(other, [fingerprint(edits.values[2]) + 1])).reduce(
            FakeEngine([False] * 4), events=0, need_norm=False, loss_scale=1.0,
            device=torch.device("cpu"), partials=lambda: torch.zeros(4), edits=edits,
            layout=type("L", (), {"pieces": ()})(), label=lambda i: f"param {i}")
    # One rank dropped parameter 1's gradient, the other did not: refused, naming it.
    edits.kind[1] = DROPPED
    with pytest.raises(RuntimeError, match="differently.*param 1: set by hand on 0, set to "
                                           "None on 1 of 2 ranks"):
        GradReduction(FakeComm(other)).reduce(
            FakeEngine([False] * 4), events=0, need_norm=False, loss_scale=1.0,
            device=torch.device("cpu"), partials=lambda: torch.zeros(4), edits=edits,
            layout=type("L", (), {"pieces": ()})(), label=lambda i: f"param {i}")


def test_reuse_shares_one_record():
    r = GradReduction(FakeComm(torch.zeros(5)))
    red = r.reduce(FakeEngine([True, True]), events=2, need_norm=False, loss_scale=2.0,
                   device=torch.device("cpu"), partials=lambda: torch.tensor([9.0, 16.0]))
    # A norm asked after a reduction without one: the squares that came with it give it.
    again = r.reuse(2, need_norm=True, loss_scale=2.0)
    assert again is red and red.has_norm and red.sq_norm == 25.0 and red.norm == 2.5
    red.clip_to(1.0)
    assert red.clip == 1.0 / (2.5 + 1e-6)
    r.reuse(2, need_norm=True, loss_scale=2.0)
    assert red.clip_before == red.clip  # the clip of earlier calls, for the returned norm
    with pytest.raises(RuntimeError, match="gradients were produced after"):
        r.reuse(3, need_norm=False, loss_scale=2.0)
    stage0 = GradReduction(FakeComm(torch.zeros(3)))
    stage0.reduce(FakeEngine([True, True], replicated=True), events=1, need_norm=False,
                  loss_scale=1.0, device=torch.device("cpu"), partials=lambda: None)
    with pytest.raises(RuntimeError, match="reduced without a norm"):
        stage0.reuse(1, need_norm=True, loss_scale=1.0)


def test_between_steps():
    r = GradReduction(FakeComm(torch.zeros(1)))
    r.count_event()
    r.finish()  # a step ended after one gradient event
    with pytest.raises(RuntimeError, match="no backward since the last step"):
        r.check_backward_since_step(r.events())
    r.count_event()
    r.check_backward_since_step(r.events())
    with pytest.raises(RuntimeError, match="stage 1 cannot do"):
        r.check_not_carried(r.events(), 1, FakeEngine([], carried=True))
    r.check_not_carried(r.events(), 0, FakeEngine([]))  # stage 0 accumulates, as torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Stages 2-3: nothing was left on p.grad (model.zero_grad()): no warning.
        r.check_not_carried(r.events(), 2, FakeEngine([]))
    r.carried = True  # a stale gradient was still on p.grad at the next backward
    with pytest.warns(UserWarning, match="no opt.zero_grad"):
        r.check_not_carried(r.events(), 2, FakeEngine([]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r.check_not_carried(r.events(), 2, FakeEngine([]))  # once
    r.forget()  # zero_grad(): nothing carried, a step may follow
    assert not r.carried
    r.check_backward_since_step(r.events())
    r.check_not_carried(r.events(), 1, FakeEngine([], carried=True))


def _torch_coef(max_norm, total_norm):
    """The factor torch.nn.utils.clip_grads_with_norm_ multiplies the gradients by, in
    float64 (a gradient of 1.0 becomes the factor itself)."""
    probe = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    probe.grad = torch.ones(1, dtype=torch.float64)
    torch.nn.utils.clip_grads_with_norm_([probe], max_norm,
                                         torch.tensor(total_norm, dtype=torch.float64))
    return probe.grad.item()


@pytest.mark.parametrize("norm", [0.3, 2.0, 7.5, math.inf])
@pytest.mark.parametrize("coef", [1.0, 0.25])
def test_clip_is_torchs_coefficient(norm, coef):
    """clip_grad_norm_(1.0) clips as torch's does; the step then applies the factor torch's
    utilities recorded through p.grad (coef) and max_grad_norm=0.5 on the clipped norm, and
    divides the loss scale by the product."""
    red = Reduced(events=0, sq_norm=norm * norm, active=[], has_norm=True, norm=norm)
    red.clip_to(1.0)
    c1 = _torch_coef(1.0, norm)
    assert red.clip == c1
    if math.isinf(norm):  # clipped by 0, as torch: finite gradients become 0
        assert c1 == 0.0 and grad_scale(red, coef, None, 8.0) == math.inf
        return
    clip = c1 * coef
    clip *= _torch_coef(0.5, norm * clip)
    assert grad_scale(red, coef, 0.5, 8.0) == 8.0 / clip


def test_a_nan_clip_gives_nan_gradients():
    red = Reduced(events=0, sq_norm=1.0, active=[], has_norm=True, norm=1.0)
    assert math.isnan(grad_scale(red, math.nan, None, 1.0))
    assert grad_scale(red, 0.0, None, 1.0) == math.inf  # clipped to 0: finite grads -> 0


def _one_hot_grads(model, seed):
    """One small integer per parameter at a random position: every partial norm is exact."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        grad = torch.zeros_like(p)
        k = int(torch.randint(0, p.numel(), (1,), generator=g))
        grad.view(-1)[k] = float(torch.randint(1, 9, (1,), generator=g)) * (-1) ** k
        p.grad = grad


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_squares_and_norm_of_a_real_engine(stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 9), nn.Linear(9, 5), nn.Linear(5, 1))
    opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, bucket_numel=64,
                             backend="torch")
    _one_hot_grads(model, 1)
    want = [float(p.grad.double().square().sum()) for p in model.parameters()]
    norm = opt.clip_grad_norm_(math.inf)
    assert norm.item() == torch.tensor(math.sqrt(math.fsum(want))).item()
    red = opt._reduction.current
    if stage == 0:
        assert red.param_sq is None
        got = opt._param_sq_partials().tolist()
    else:
        got = red.param_sq
    assert got == want
    opt.step()
    assert opt._reduction.current is None
    assert opt.last_grad_norm == math.sqrt(math.fsum(want))
