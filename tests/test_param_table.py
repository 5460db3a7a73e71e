"""The param table (zerokern/zero/param_table.py): which parameters a ZeroAdamW trains, their
indices, shapes and step counts, and the ranges of one fused update. One process, no process
group; the step counts are checked against torch.optim.AdamW's own state[p]["step"]."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerokern
from zerokern.comm import Comm
from zerokern.zero.layout import build_layout
from zerokern.zero.param_table import (
    ParamTable,
    broadcast_params,
    stage3_runtime,
    trained_params,
)


def _params(*shapes, frozen=()):
    ps = [nn.Parameter(torch.zeros(s)) for s in shapes]
    for i in frozen:
        ps[i].requires_grad_(False)
    return ps


def test_trained_and_frozen_in_group_order():
    a, b, c, d = _params((2, 3), (4,), (5,), (1, 1), frozen=(1,))
    groups = [{"params": [a, b]}, {"params": [c, d]}]
    managed, frozen = trained_params(groups)
    assert managed == [[a], [c, d]] and frozen == [b]
    t = ParamTable(managed, frozen)
    assert t.params == [a, c, d]
    assert t.index == {id(a): 0, id(c): 1, id(d): 2}
    assert t.shapes == [torch.Size((2, 3)), torch.Size((5,)), torch.Size((1, 1))]
    assert t.group_sizes == [[6], [5, 1]] and t.group_counts() == [1, 2]
    assert t.steps == [0, 0, 0]


def test_refusals():
    (a,) = _params((3,))
    with pytest.raises(ValueError, match="lists the same parameter twice"):
        trained_params([{"params": [a, a]}])
    (f,) = _params((3,), frozen=(0,))
    with pytest.raises(ValueError, match="no parameter requires grad"):
        trained_params([{"params": [f]}])
    (e,) = _params((0,))
    with pytest.raises(ValueError, match="0 elements"):
        trained_params([{"params": [e]}])
    # Not partitioned by shard_model: only stages 0-2.
    assert stage3_runtime([a], 2) is None
    with pytest.raises(ValueError, match="shard_model"):
        stage3_runtime([a], 3)


def test_frozen_then_trainable_is_refused():
    a, b = _params((2,), (3,), frozen=(1,))
    managed, frozen = trained_params([{"params": [a, b]}])
    t = ParamTable(managed, frozen)
    t.check_frozen()
    b.requires_grad_(True)
    with pytest.raises(RuntimeError, match="had requires_grad=False"):
        t.check_frozen()


def test_append_extends_the_same_list():
    a, b, c = _params((2,), (3,), (4,))
    t = ParamTable([[a]], [])
    same = t.params
    first = t.append([b, c], t.shapes_of([b, c]), frozen=[])
    assert first == 1 and t.params is same and same == [a, b, c]
    assert t.index[id(c)] == 2 and t.group_sizes == [[2], [3, 4]] and t.steps == [0, 0, 0]


def _covering(runs):
    """Local element -> (group, step) of the run that covers it; every element at most once."""
    out = {}
    for r in runs:
        for e in range(r.start, r.stop):
            assert e not in out, f"element {e} in two runs"
            out[e] = (r.group, r.step)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_runs_cover_exactly_the_active_parameters(stage):
    # Two groups, uneven sizes, a bucket size that splits parameters across buckets.
    sizes = [[7, 33, 5], [64, 1, 30]]
    flat = [n for g in sizes for n in g]
    ps = _params(*[(n,) for n in flat])
    t = ParamTable([ps[:3], ps[3:]], [])
    t.steps = [0, 4, 4, 2, 2, 2]
    layout = build_layout(t.group_sizes, stage=stage, world_size=1, rank=0, bucket_numel=40)
    active = [True, True, False, True, True, True]
    cover = _covering(t.runs(layout, active))
    # Independent of how runs merge: every element of an active parameter is covered once,
    # with its group and its next step; nothing else but alignment padding inside a run.
    want = {}
    for pc in layout.pieces:
        if pc.param >= 0 and active[pc.param]:
            for e in range(pc.local_start, pc.local_start + pc.numel):
                want[e] = (pc.group, t.steps[pc.param] + 1)
    for e, gs in want.items():
        assert cover[e] == gs
    owned = {e for pc in layout.pieces if pc.param >= 0
             for e in range(pc.local_start, pc.local_start + pc.numel)}
    assert not any(e in owned and e not in want for e in cover), "an inactive param updated"
    # Different step counts are never merged into one run.
    for r in t.runs(layout, active):
        steps = {t.steps[pc.param] for pc in layout.pieces
                 if pc.param >= 0 and pc.local_start < r.stop
                 and pc.local_start + pc.numel > r.start}
        assert steps == {r.step - 1}


def test_steps_follow_torch_adamw():
    """A parameter with no gradient is not stepped, as torch's AdamW leaves it."""
    torch.manual_seed(0)
    base = nn.ModuleDict({"a": nn.Linear(3, 4), "b": nn.Linear(4, 2), "c": nn.Linear(3, 2)})
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = zerokern.ZeroAdamW(ours.parameters(), lr=1e-2, stage=2, backend="torch")
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(5, 3, generator=g)
        for m, o in ((ours, opt), (ref, ropt)):
            h = m["a"](x)
            out = m["b"](h).sum() + (m["c"](x).sum() if step % 2 else 0.0)
            out.backward()
            o.step()
            o.zero_grad()
    for i, p in enumerate(ref.parameters()):
        want = int(ropt.state[p]["step"]) if p in ropt.state else 0
        assert opt.shards_step(i) == want
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_broadcast_at_world_size_one_changes_nothing():
    (a,) = _params((3,))
    with torch.no_grad():
        a.copy_(torch.tensor([1.0, 2.0, 3.0]))
    broadcast_params(Comm(None), [a])
    assert a.tolist() == [1.0, 2.0, 3.0]
