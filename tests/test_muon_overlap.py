"""Muon's shard exchange overlapped with the step (zerokern.comm.shard_pipeline) against the
synchronous schedule (``set_chunks(0)``: two blocking all-to-alls), at stages 1-3 on 2 ranks:
the same parameters and momentum BIT FOR BIT (each element sees the same operations on the
same values, only earlier or later), the same bytes on the wire (only the number of
all-to-all calls grows, by the chunks beyond one), and the recorded order of the last step
(the exchange's ``events``: issues, waits, and the step's Newton-Schulz and weight decay
in between) shows computation while a collective was in flight: the weight decay and the
Newton-Schulz of the batches an owner holds whole during the owner-bound all-to-all on every
rank, and Newton-Schulz of a next chunk while a chunk of results travels back on some rank.
No clock: the order is what is checked. One launch (the pool's ranks) for all three stages
(buckets that split every matrix) and stage 1 with the default buckets (where an owner holds
batches whole, so their Newton-Schulz runs during the first all-to-all); and the part alone
(PipelinedShardExchange) against the synchronous ShardExchange on runs laid out by hand."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from test_zero_muon import ADAMW, BUCKET, MATRICES, MUON, MuonNet, _build, _full, _split, _train

import zerokern
from zerokern.zero.muon_step import DEFAULT_CHUNKS

STEPS = 2


def _between(events, issue, wait, kind):
    """Whether an event of ``kind`` lies between ``issue`` and ``wait``."""
    i, j = events.index(issue), events.index(wait)
    return any(e[0] == kind for e in events[i + 1:j])


def overlap_case(rank: int, world: int) -> None:
    torch.manual_seed(0)
    base = MuonNet()
    # Small buckets (test_zero_muon's) split every matrix over both ranks; the default ones
    # leave rank 1 owning two batches it holds whole (orthogonalized during the first
    # all-to-all: asserted below).
    whole_seen = []
    for stage, bucket in ((1, BUCKET), (2, BUCKET), (3, BUCKET), (1, None)):
        runs = {}
        for chunks in (0, DEFAULT_CHUNKS):
            if bucket is None:
                model = copy.deepcopy(base)
                muon, rest = _split(model, MATRICES)
                om = zerokern.ZeroOptimizer(muon, torch.optim.Muon, stage=stage, **MUON)
                oa = zerokern.ZeroOptimizer(rest, torch.optim.AdamW, stage=stage, **ADAMW)
            else:
                model, om, oa = _build(base, stage, MATRICES)
            om._rule_state.set_chunks(chunks)
            _train(model, (om, oa), world, rank, 0, STEPS)
            runs[chunks] = (model, om)
        (m0, o0), (m1, o1) = runs[0], runs[DEFAULT_CHUNKS]
        what = f"stage {stage} bucket {bucket}"
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
        whole_seen.append(bool(sx.local_batches()))
        # Every batch this rank owns ran Newton-Schulz once; every chunk went and came.
        assert sorted(e[1] for e in ev if e[0] == "ns") == list(range(len(
            plan.batches[rank]))), ev
        for c in range(chunks):
            assert ev.index(("issue", c)) < ev.index(("wait", c)), ev
        piped = any(_between(ev, ("issue", c), ("wait", c), "ns") for c in range(chunks))
        flags = [None] * world
        dist.all_gather_object(flags, piped)
        assert any(flags), (what, flags)
    flags = [None] * world
    dist.all_gather_object(flags, whole_seen[-1])
    assert any(flags), flags  # default buckets: NS ran during the owner-bound all-to-all
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="chunks"):
            o1._rule_state.set_chunks(bad)
    assert o1._rule_state.chunks == DEFAULT_CHUNKS


def test_overlapped_exchange_equals_synchronous_bit_for_bit(tmp_path):
    run_ranks(2, overlap_case, tmp_path=tmp_path)


def pipeline_part_case(rank: int, world: int) -> None:
    """The part alone (PipelinedShardExchange), on runs laid out by hand so that each owner
    holds some of its matrices whole and others are split across the ranks: the batches held
    whole are complete in the segment while the owner-bound all-to-all is still in flight;
    after it, the segment is the synchronous exchange's; the results come back, chunk by
    chunk, as the synchronous ``from_owners`` gives them; with every unit and with some
    inactive."""
    from zerokern.comm import Comm
    from zerokern.comm.owner_exchange import segment_view
    from zerokern.comm.shard_exchange import ShardExchange, ShardPiece
    from zerokern.comm.shard_pipeline import PipelinedShardExchange
    from zerokern.optim.muon_plan import plan_muon

    plan = plan_muon([(4, 4), (4, 4), (6, 2), (2, 6), (8, 4), (3, 5), (5, 3)], world)
    pieces = [[] for _ in range(world)]
    for u in plan.units:  # even units whole on their owner, odd ones split over both ranks
        if u.index % 2 == 0:
            pieces[u.owner].append(ShardPiece(u.index, 0, u.numel))
        else:
            half = u.numel // 2
            pieces[0].append(ShardPiece(u.index, 0, half))
            pieces[1].append(ShardPiece(u.index, half, u.numel - half))
    for active in ([True] * len(plan.units), [i != 1 and i != 4 for i in range(7)]):
        mine = [p for p in pieces[rank] if active[p.unit]]
        values = [torch.arange(p.offset, p.offset + p.numel, dtype=torch.float32)
                  + 100 * p.unit for p in mine]
        sync = ShardExchange(plan, Comm(), pieces, torch.float32, torch.bfloat16, "cpu")
        want_seg = sync.to_owners(values, active).clone()
        sync.param_segment.copy_(want_seg * 2)
        want = [t.clone() for t in sync.from_owners(active)]
        px = PipelinedShardExchange(plan, Comm(), pieces, torch.float32, torch.bfloat16,
                                    "cpu")
        pending = px.start_to_owners(values, active)
        local = px.local_batches()
        assert local == [b for b, batch in enumerate(plan.batches[rank])
                         if all(u % 2 == 0 for u in batch.units)], local
        flags = [None] * world
        dist.all_gather_object(flags, bool(local))
        assert any(flags), flags  # the layout gives some owner a batch held whole
        for b in local:  # complete before the wait
            for u in plan.batches[rank][b].units:
                if active[u]:
                    v = segment_view(px.grad_segment, plan.units[u])
                    assert torch.equal(v, segment_view(want_seg, plan.units[u])), u
        assert torch.equal(pending.wait(), want_seg)
        chunks = 3
        batches, chunk_of = px.chunk_batches(chunks)
        assert set(chunk_of) == set(range(len(plan.units)))
        assert sorted(b for c in batches for b in c) == list(range(len(plan.batches[rank])))
        got = {}
        sent = []
        for c in range(chunks):
            for b in batches[c]:
                for u in plan.batches[rank][b].units:
                    v = segment_view(px.param_segment, plan.units[u])
                    v.copy_(segment_view(px.grad_segment, plan.units[u]) * 2)
            sent.append(px.start_back(c, chunks, active))
        for h in sent:
            for i, t in h.wait():
                assert i not in got
                got[i] = t.clone()
        assert sorted(got) == list(range(len(want)))
        for i, t in enumerate(want):
            assert torch.equal(got[i], t), (active, i)
        ev = px.events
        assert ev[:2] == [("issue", "to_owners"), ("wait", "to_owners")], ev
        assert ev[2:] == [("issue", c) for c in range(chunks)] + [
            ("wait", c) for c in range(chunks)], ev
        with pytest.raises(ValueError, match="chunk"):
            px.start_back(chunks, chunks, active)


def test_pipelined_part_equals_the_synchronous_exchange(tmp_path):
    run_ranks(2, pipeline_part_case, tmp_path=tmp_path)


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
