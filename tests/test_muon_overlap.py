"""Muon's shard exchange overlapped with the step (zerokern.comm.shard_pipeline) against the
synchronous schedule (``set_chunks(0)``: two blocking all-to-alls), at stages 1-3 on 2 ranks:
the same parameters and momentum BIT FOR BIT (each element sees the same operations on the
same values, only earlier or later), the same bytes on the wire (only the number of
all-to-all calls grows, by the chunks beyond one), and the recorded order of the last step
(the exchange's ``events``: issues, waits, and the step's Newton-Schulz and weight decay
in between) shows computation while a collective was in flight: the weight decay and the
Newton-Schulz of the batches an owner holds whole during the owner-bound all-to-all on every
rank, and Newton-Schulz of a next chunk while a chunk of results travels back on some rank.
No clock: the order is what is checked. One launch (the pool's ranks) for all three stages."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from test_zero_muon import MATRICES, MuonNet, _build, _full, _train

from zerokern.zero.muon_step import DEFAULT_CHUNKS

STEPS = 2


def _between(events, issue, wait, kind):
    """Whether an event of ``kind`` lies between ``issue`` and ``wait``."""
    i, j = events.index(issue), events.index(wait)
    return any(e[0] == kind for e in events[i + 1:j])


def overlap_case(rank: int, world: int) -> None:
    torch.manual_seed(0)
    base = MuonNet()
    for stage in (1, 2, 3):
        runs = {}
        for chunks in (0, DEFAULT_CHUNKS):
            model, om, oa = _build(base, stage, MATRICES)
            om._rule_state.set_chunks(chunks)
            _train(model, (om, oa), world, rank, 0, STEPS)
            runs[chunks] = (model, om)
        (m0, o0), (m1, o1) = runs[0], runs[DEFAULT_CHUNKS]
        what = f"stage {stage}"
        full0, full1 = _full(m0), _full(m1)
        for name, a in full0.items():
            assert torch.equal(a, full1[name]), (what, name, (a - full1[name]).abs().max())
        s0 = o0.full_state_dict(rank0_only=False)["state"]
        s1 = o1.full_state_dict(rank0_only=False)["state"]
        for i, st in s0.items():
            assert torch.equal(st["momentum_buffer"], s1[i]["momentum_buffer"]), (what, i)
        k0 = o0.comm_stats()["per_kind"]["all_to_all"]
        k1 = o1.comm_stats()["per_kind"]["all_to_all"]
        sx = o1._rule_state._shard
        plan = o1._rule_state.plan
        chunks = min(DEFAULT_CHUNKS, max(len(b) for b in plan.batches))
        assert chunks >= 2, plan.batches  # the shapes give the pipeline something to do
        assert k1["bytes"] == k0["bytes"] > 0 and k1["wire_elements"] == k0["wire_elements"]
        assert k0["calls"] == 2 and k1["calls"] == 1 + chunks, (k0, k1)  # the last step's
        ev = sx.events
        assert ev[0] == ("issue", "to_owners"), ev
        assert _between(ev, ("issue", "to_owners"), ("wait", "to_owners"), "decay"), ev
        for b in sx.local_batches():  # held whole: orthogonalized while the others travel
            assert ev.index(("ns", b)) < ev.index(("wait", "to_owners")), (b, ev)
        # Every batch this rank owns ran Newton-Schulz once; every chunk went and came.
        assert sorted(e[1] for e in ev if e[0] == "ns") == list(range(len(
            plan.batches[rank]))), ev
        for c in range(chunks):
            assert ev.index(("issue", c)) < ev.index(("wait", c)), ev
        piped = any(_between(ev, ("issue", c), ("wait", c), "ns") for c in range(chunks))
        flags = [None] * world
        dist.all_gather_object(flags, piped)
        assert any(flags), (what, flags)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="chunks"):
            o1._rule_state.set_chunks(bad)
    assert o1._rule_state.chunks == DEFAULT_CHUNKS


def test_overlapped_exchange_equals_synchronous_bit_for_bit(tmp_path):
    run_ranks(2, overlap_case, tmp_path=tmp_path)


def test_one_rank_overlapped_runs_locally():
    """One process, no group: the overlapped schedule's collectives are local copies (the
    Comm's one-rank path returns a completed handle) and the result is the synchronous one."""
    torch.manual_seed(0)
    base = MuonNet()
    out = []
    for chunks in (0, 2):
        model, om, oa = _build(base, 1, MATRICES)
        om._rule_state.set_chunks(chunks)
        _train(model, (om, oa), 1, 0, 0, STEPS)
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, a in out[0].items():
        assert torch.equal(a, out[1][name]), name
