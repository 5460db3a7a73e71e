"""Single-process tests of the gradient path of stages 0-2: the bucket sequencer (grads.py)
against a recording fake of a stage's bucket operations, and the stage engines against a fake
communicator that plays identical peers (so every average must equal the local gradient:
the division by N happens exactly once)."""

from __future__ import annotations

import random

import pytest
import torch

from zerokern.zero.grads import BucketPhase, GradReducer
from zerokern.zero.layout import build_layout
from zerokern.zero.stages import Stage0, Stage1, Stage2

NUMELS = [5, 40, 3, 70, 9, 90, 17]


def _params(numels=NUMELS, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in numels]


def _int_grad(n, seed, dtype=torch.float32):
    # Small integers: sums and halvings are exact in bf16 too.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


class FakeHandle:
    def __init__(self, log, b):
        self.log, self.b, self.waited = log, b, False

    def wait(self):
        self.waited = True
        self.log.append(("wait", self.b))


class RecordingOps:
    """BucketOps that records what the sequencer asks, reducing nothing."""

    def __init__(self, layout, asynchronous=True):
        self.layout, self.asynchronous, self.log = layout, asynchronous, []
        self.bufs = {b.index: torch.full((b.numel,), float("nan")) for b in layout.buckets}

    def bucket_tensor(self, b):
        return self.bufs[b]

    def start_reduce(self, b, src, accumulate):
        self.log.append(("start", b, accumulate))
        return FakeHandle(self.log, b) if self.asynchronous else None

    def finish_reduce(self, b, src):
        self.log.append(("finish", b))

    def after_delivery(self, index):
        pass

    def settle(self):
        pass

    def keeps_earlier_rounds(self):
        return False


def _layout(stage=2, world=2, rank=0, bucket=64, numels=NUMELS):
    return build_layout([numels], stage=stage, world_size=world, rank=rank, bucket_numel=bucket)


def _starts(log):
    return [e[1] for e in log if e[0] == "start"]


def test_buckets_reduce_in_index_order_whatever_the_gradient_order():
    L = _layout()
    assert len(L.buckets) >= 3
    for seed in range(20):
        params = _params()
        for i, p in enumerate(params):
            p.grad = _int_grad(p.numel(), i)
        ops = RecordingOps(L)
        red = GradReducer(L, params, ops, overlap=True, backend=None)
        order = list(range(len(params)))
        random.Random(seed).shuffle(order)
        for i in order:
            red.on_grad_ready(i, in_backward=False)
            started = _starts(ops.log)
            assert started == list(range(len(started)))  # never out of order
            for b, st in enumerate(red.buckets):
                if b >= len(started):  # not started: complete ones wait their turn
                    assert st.phase in (BucketPhase.EMPTY, BucketPhase.FILLING,
                                        BucketPhase.FULL)
                else:
                    assert st.phase is BucketPhase.REDUCING
        assert _starts(ops.log) == list(range(len(L.buckets)))
        red.flush()
        assert all(st.phase is BucketPhase.REDUCED for st in red.buckets)
        # finish in issue order, each after its wait
        fin = [e[1] for e in ops.log if e[0] == "finish"]
        assert fin == list(range(len(L.buckets)))
        for b in range(len(L.buckets)):
            assert ops.log.index(("wait", b)) < ops.log.index(("finish", b))


def test_flush_zero_fills_what_this_rank_never_produced_and_copies_the_rest():
    L = _layout()
    params = _params()
    for i, p in enumerate(params):
        p.grad = _int_grad(p.numel(), i)
    ops = RecordingOps(L, asynchronous=False)
    red = GradReducer(L, params, ops, overlap=False, backend=None)
    skip = {1, 3, 6}
    for i in range(len(params)):
        if i not in skip:
            red.on_grad_ready(i, in_backward=False)
    red.flush()
    assert _starts(ops.log) == list(range(len(L.buckets)))
    for i, p in enumerate(params):
        for b, boff, poff, n in red.frags[i]:
            got = ops.bufs[b][boff:boff + n]
            want = torch.zeros(n) if i in skip else p.grad.reshape(-1)[poff:poff + n]
            assert torch.equal(got, want), (i, b)
    assert red.got_grad == [i not in skip for i in range(len(params))]


def test_a_second_backward_starts_a_new_round_that_accumulates():
    L = _layout()
    params = _params()
    for i, p in enumerate(params):
        p.grad = _int_grad(p.numel(), i)
    ops = RecordingOps(L)
    red = GradReducer(L, params, ops, overlap=True, backend=None)
    nb = len(L.buckets)
    red.on_grad_ready(4, in_backward=False)
    red.on_grad_ready(2, in_backward=False)
    red.on_grad_ready(4, in_backward=False)  # delivered twice: a new backward began
    assert red.rounds == 1
    first = [e for e in ops.log if e[0] == "start"][:nb]
    assert [e[1] for e in first] == list(range(nb)) and not any(e[2] for e in first)
    for i in range(len(params)):
        if i != 4:
            red.on_grad_ready(i, in_backward=False)
    red.flush()
    second = [e for e in ops.log if e[0] == "start"][nb:]
    assert [e[1] for e in second] == list(range(nb)) and all(e[2] for e in second)
    red.reset()
    assert red.rounds == 0 and all(st.phase is BucketPhase.EMPTY for st in red.buckets)


def test_no_sync_delivers_nothing_and_max_inflight_is_kept():
    L = _layout(bucket=32)
    params = _params()
    for i, p in enumerate(params):
        p.grad = _int_grad(p.numel(), i)
    ops = RecordingOps(L)
    red = GradReducer(L, params, ops, overlap=True, backend=None, max_inflight=2)
    red.sync = False
    for i in range(len(params)):
        red.on_grad_ready(i, in_backward=False)
    assert ops.log == [] and not any(red.got_grad)
    red.sync = True
    for i in reversed(range(len(params))):
        red.on_grad_ready(i, in_backward=False)
        assert len(red.inflight) <= 2
    red.flush()
    assert _starts(ops.log) == list(range(len(L.buckets)))


# -- stage engines against a fake communicator ---------------------------------------------------
class PeerComm:
    """N identical ranks: every peer produced the same tensor as this one, so a sum over ranks
    is N x the local value (exact for small integers) and an all-gather receives, from peer k,
    what this rank would hold in its place (kept from ``peer_values``)."""

    replicate = None  # a flat group

    def __init__(self, world, rank):
        self.world_size, self.rank = world, rank
        self.scratch_peak = 0
        self.calls = []

    def in_place_scratch(self):
        return False

    def _handle(self, async_op, what):
        self.calls.append(what)
        return FakeHandle([], what) if async_op else None

    def all_reduce(self, t, label="", async_op=False, **_):
        t.mul_(self.world_size)
        return self._handle(async_op, "all_reduce")

    def reduce_scatter(self, out, inp, label="", async_op=False):
        mine = inp.view(self.world_size, -1)[self.rank]
        out.copy_(mine * self.world_size)
        return self._handle(async_op, "reduce_scatter")

    def all_gather(self, out, inp, label="", async_op=False, **_):
        out.view(self.world_size, -1)[self.rank].copy_(inp)
        return self._handle(async_op, "all_gather")


# Stage 1 with two backwards is left out: after its first round each rank holds the sum in
# its own slice only, so the peers' buckets are no longer copies of this one, which PeerComm
# cannot play. The multi-rank parity tests cover accumulation at stage 1.
@pytest.mark.parametrize("engine,backwards",
                         [(Stage0, 1), (Stage0, 2), (Stage1, 1), (Stage2, 1), (Stage2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 2)])
def test_stage_engines_average_exactly_once(engine, backwards, dtype, world, rank):
    L = build_layout([NUMELS[:3], NUMELS[3:]], stage=engine.stage, world_size=world,
                     rank=rank, bucket_numel=64)
    params = _params(dtype=dtype)
    comm = PeerComm(world, rank)
    eng = engine(L, params, comm, dtype=dtype, device=torch.device("cpu"), overlap=True,
                 backend="torch")
    total = [torch.zeros(p.numel(), dtype=dtype) for p in params]
    for k in range(backwards):
        for i in L.ready_order:
            g = _int_grad(params[i].numel(), 10 * k + i, dtype)
            total[i] += g
            if params[i].grad is None:
                params[i].grad = g.clone()
            else:  # autograd accumulates into whatever .grad is (a bucket view at 0/1)
                params[i].grad += g
            eng.reducer.on_grad_ready(i, in_backward=False)
        eng.reducer.drain()  # what the end-of-backward callback does
    got = eng.finish_grads()
    assert got == [True] * len(params)
    assert "reduce_scatter" in comm.calls or engine is Stage0
    # Every element this rank holds the averaged gradient of equals the local total (every
    # peer produced the same): divided by N once, not zero and not twice.
    for pc in L.pieces:
        want = total[pc.param][pc.param_offset:pc.param_offset + pc.numel]
        if engine is Stage2:
            have = eng.grad_shard.narrow(0, pc.local_start, pc.numel)
        else:
            fs = L.param_flat_offset[pc.param] + pc.param_offset
            have = eng.flat_grad.narrow(0, fs, pc.numel)
        assert torch.equal(have, want), (pc, have, want)
    eng.end_step()
    assert eng.reducer.rounds == 0
