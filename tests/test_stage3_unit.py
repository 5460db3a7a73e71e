"""Stage 3's unit lifecycle (zerokern/zero/stage3/) in one process, with no process group: the
unit's transitions (the legal ones move it, the illegal ones raise IllegalTransition and move
nothing), gather/release against the placeholder and the arena, the reduce of a unit at world
size 1 against its gradients (exact: no division, a copy), a further backward of the same step
adding to the slice (exact against float64), the offload branches, the prefetch order, and
autograd's saved tensors re-pointed into wherever their unit is gathered.

Asynchronous collectives are simulated by AsyncComm: a world-size-1 Comm whose gathers and
reduce-scatters complete at once but hand back a handle to wait on, as a multi-rank group does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import Block, TinyGPT, batch
from torch import nn

import zerokern
from zerokern.comm import CollectiveError, CollectiveTimeout, Comm
from zerokern.zero.offload import Ticket
from zerokern.zero.registry import runtime_of_module
from zerokern.zero.stage3 import GradPhase, IllegalTransition, Stage3Runtime, UnitState
from zerokern.zero.stage3.context import GATHER_ALIGN, gather_arena_bytes
from zerokern.zero.stage3.order import ForwardOrder
from zerokern.zero.stage3.saved import _GatheredRef

SHARDED, GATHERING, GATHERED, REDUCING = (UnitState.SHARDED, UnitState.GATHERING,
                                          UnitState.GATHERED, UnitState.REDUCING)


class _Work:
    """A collective's handle: done at once, recording that it was waited on."""

    def __init__(self, fail: bool = False) -> None:
        self.waited, self.fail = 0, fail

    def wait(self, timeout: float | None = None) -> bool:
        if self.fail:
            raise CollectiveTimeout("fake: the other ranks did not join", 2.5)
        self.waited += 1
        return True


class AsyncComm(Comm):
    """World size 1, but asynchronous collectives return a handle (``works``)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.works: list[_Work] = []
        self.fail = fail

    def _handle(self, async_op: bool) -> _Work | None:
        if not async_op:
            return None
        self.works.append(_Work(self.fail))
        return self.works[-1]

    def all_gather(self, out, inp, label="shard", async_op=False, *, count=True):
        super().all_gather(out, inp, label, count=count)
        return self._handle(async_op)

    def reduce_scatter(self, out, inp, label="bucket", async_op=False):
        super().reduce_scatter(out, inp, label)
        return self._handle(async_op)


class TwoUnits(nn.Module):
    """Two units of odd sizes (so plans have padding) and a parameter left to the root."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(3, 7, bias=False)
        self.scale = nn.Parameter(torch.randn(7))
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.scale


def _runtime(comm: Comm | None = None, *, dtype=torch.float32, offload_params=False,
             overlap=False) -> tuple[Stage3Runtime, dict[int, torch.Tensor]]:
    """A runtime over TwoUnits (no hooks installed: the tests move the units themselves) and
    the original values of its parameters."""
    torch.manual_seed(0)
    m = TwoUnits(dtype)
    values = {id(p): p.detach().clone() for p in m.parameters()}
    units = [("a", m.a, list(m.a.parameters())), ("b", m.b, list(m.b.parameters())),
             ("<root>", m, [m.scale])]
    rt = Stage3Runtime(m, units, comm or Comm(), prefetch=1, reshard_after_forward=True,
                       offload_params=offload_params)
    rt.shard_parameters()
    rt.ctx.overlap = overlap  # a world-size-1 Comm would run everything synchronously
    return rt, values


def _is_placeholder(rt: Stage3Runtime, p: torch.Tensor, shape: torch.Size) -> bool:
    return (p.data_ptr() == rt.ctx.nan.data_ptr() and p.shape == shape
            and bool(torch.isnan(p).all()))


def _set_grads(u, values) -> None:
    for p, g in zip(u.params, values):
        p.grad = g.clone()


def _int_grads(u, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Small-integer gradients: their sums are exact in any dtype and any order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-60, 61, s, generator=g).to(dtype) for s in u.shapes]


def _flat(u, grads: list[torch.Tensor]) -> torch.Tensor:
    """The unit's flat space at world size 1: each gradient at its offset, zeros between."""
    out = torch.zeros(u.plan.padded_numel, dtype=grads[0].dtype)
    for g, off, n in zip(grads, u.plan.param_offsets, u.plan.numels):
        out[off : off + n] = g.reshape(-1)
    return out


# -- storage: gather / release -----------------------------------------------------------------
def test_starts_sharded_with_placeholders_and_values_in_the_slice():
    rt, values = _runtime()
    assert [u.state for u in rt.units] == [SHARDED] * 3
    assert [u.phase for u in rt.units] == [GradPhase.IDLE] * 3
    for u in rt.units:
        for p, shape in zip(u.params, u.shapes):
            assert _is_placeholder(rt, p, shape)
        assert torch.equal(u.slice_of(rt.local_params), _flat(u, [values[id(p)] for p in u.params]))
    with pytest.raises(RuntimeError):
        rt.units[0].params[0].data.add_(1)  # a placeholder cannot be written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_then_release_returns_the_buffer_and_the_placeholder(dtype):
    rt, values = _runtime(dtype=dtype)
    a, b, root = rt.units
    arena = rt.gather_arena
    a.gather()
    assert a.state is GATHERED and a.gathered and a.buf is not None and a.block is not None
    for p in a.params:
        assert torch.equal(p, values[id(p)])  # bitwise the values sharded
        assert p.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
    in_use = arena.stats()["in_use"]
    assert in_use >= a.plan.padded_numel * a.buf.element_size()
    buf = a.buf
    a.gather()  # already gathered: nothing moves
    assert a.buf is buf and arena.stats()["in_use"] == in_use
    b.gather()
    root.gather()
    assert (rt.ctx.gathered_units, rt.peak_units) == (2, 2)  # the root is not counted
    a.release()
    assert a.state is SHARDED and a.buf is None and a.block is None
    for p, shape in zip(a.params, a.shapes):
        assert _is_placeholder(rt, p, shape)
    a.release()  # nothing held: nothing to do (as FSDP2's reshard)
    b.release()
    root.release()
    assert arena.stats()["in_use"] == 0 and rt.ctx.gathered_units == 0 and rt.peak_units == 2
    assert rt.overflow_bytes == 0


def test_async_gather_is_gathering_until_waited():
    comm = AsyncComm()
    rt, values = _runtime(comm, overlap=True)
    a, b, _ = rt.units
    a.gather(wait=False)  # a prefetch
    assert a.state is GATHERING and a.gathered and comm.works[-1].waited == 0
    a.gather()
    assert a.state is GATHERED and a.work is None and comm.works[-1].waited == 1
    b.gather(wait=False)
    b.release()  # a release waits for the gather in flight first
    assert b.state is SHARDED and comm.works[-1].waited == 1
    assert all(torch.equal(p, values[id(p)]) for p in a.params)


def test_gather_timeout_breaks_the_context_and_abandons_the_buffer():
    rt, _ = _runtime(AsyncComm(fail=True), overlap=True)
    a, b, _ = rt.units
    a.gather(wait=False)
    with pytest.raises(CollectiveTimeout, match="all-gather of the parameters of unit 'a'"):
        a.gather()
    assert a.state is GATHERING and rt.broken is not None
    a.release()  # the pending gather may still write the buffer: it never goes back
    assert a.state is SHARDED and len(rt.ctx.abandoned) == 1
    assert rt.gather_arena.stats()["in_use"] > 0
    with pytest.raises(RuntimeError, match="did not join"):
        b.gather()
    assert b.state is SHARDED


def test_failed_gather_gives_its_buffer_back_on_release():
    class PeerDied(Comm):
        def all_gather(self, out, inp, label="shard", async_op=False, *, count=True):
            raise CollectiveError("fake: a peer died")

    rt, _ = _runtime(PeerDied())
    a = rt.units[0]
    with pytest.raises(CollectiveError, match="peer died"):
        a.gather()
    assert a.state is GATHERING and rt.gather_arena.stats()["in_use"] > 0
    a.release()
    assert a.state is SHARDED and rt.gather_arena.stats()["in_use"] == 0
    assert all(_is_placeholder(rt, p, s) for p, s in zip(a.params, a.shapes))


def test_offload_params_gathers_from_the_host_slice():
    rt, values = _runtime(offload_params=True)
    a = rt.units[0]
    assert rt.copier is not None and rt.param_arena.device.type == "cpu"
    a.gather()
    assert a.h2d is not None and all(torch.equal(p, values[id(p)]) for p in a.params)
    a.release()
    assert a.h2d is None and a.state is SHARDED
    assert rt.memory_stats()["local_params_on_host"] == 1


def test_assigned_values_are_adopted_at_the_next_gather():
    rt, _ = _runtime()
    a = rt.units[0]
    w = a.params[0]
    new = torch.full(a.shapes[0], 0.5)
    w.data = new.clone()  # p.data = t on a released parameter
    a.gather()
    assert torch.equal(w, new) and rt.take_adopted() == [w]
    a.release()
    w.data = torch.zeros(2, 2)  # another shape is refused before anything changes
    with pytest.raises(RuntimeError, match="now has shape"):
        a.gather()
    assert a.state is SHARDED


# -- the gradient side --------------------------------------------------------------------------
def test_grad_phase_transitions():
    rt, _ = _runtime()
    u = rt.units[0]
    every = lambda p: True  # noqa: E731
    u.begin_backward(every)
    assert u.phase is GradPhase.BACKWARD and u.in_backward and u.waiting == {0, 1}
    assert not u.grad_arrived(1) and u.grad_arrived(0)  # due: both; then none
    u.end_backward(reduced=False)  # no_sync: the gradients stay on the parameters
    assert u.phase is GradPhase.IDLE and u.waiting == set()
    u.begin_backward(lambda p: p is u.params[0])  # only the optimizer's parameters are due
    assert u.waiting == {0}
    u.end_backward(reduced=True)
    assert u.phase is GradPhase.REDUCED
    u.begin_backward(every)
    assert u.phase is GradPhase.BACKWARD_AGAIN
    u.end_backward(reduced=False)  # the slice keeps what the first backward reduced
    assert u.phase is GradPhase.REDUCED
    u.new_step()
    assert u.phase is GradPhase.IDLE
    u.begin_backward(every)
    u.end_backward(reduced=True)
    u.begin_backward(every)
    u.new_step()  # a backward under way stays one, but no longer adds to the slice
    assert u.phase is GradPhase.BACKWARD


@pytest.mark.parametrize("verb,setup,match", [
    ("reduce", None, r"reduce is not allowed in GradPhase.IDLE"),
    ("end_backward", None, r"end_backward is not allowed in GradPhase.IDLE"),
    ("begin_backward", "begin", r"begin_backward is not allowed in GradPhase.BACKWARD \("),
    ("begin_backward", "again", r"begin_backward is not allowed in GradPhase.BACKWARD_AGAIN"),
    ("finish_reduce", None, r"finish_reduce is not allowed in UnitState.SHARDED"),
    ("finish_reduce", "gather", r"finish_reduce is not allowed in UnitState.GATHERED"),
    ("take_shard", "gather", r"take_shard is not allowed in UnitState.GATHERED"),
])
def test_illegal_transitions_raise_and_move_nothing(verb, setup, match):
    rt, _ = _runtime()
    u = rt.units[0]
    every = lambda p: True  # noqa: E731
    if setup == "begin":
        u.begin_backward(every)
    elif setup == "again":
        u.begin_backward(every)
        u.end_backward(reduced=True)
        u.begin_backward(every)
    elif setup == "gather":
        u.gather()
    before = (u.state, u.phase, set(u.waiting), rt.gather_arena.stats()["in_use"])
    call = {"reduce": lambda: u.reduce(every), "end_backward": lambda: u.end_backward(True),
            "begin_backward": lambda: u.begin_backward(every),
            "finish_reduce": u.finish_reduce,
            "take_shard": lambda: u.take_shard(torch.zeros(u.plan.padded_numel))}[verb]
    with pytest.raises(IllegalTransition, match=match) as info:
        call()
    assert "stage 3 unit 'a'" in str(info.value)
    assert (u.state, u.phase, set(u.waiting), rt.gather_arena.stats()["in_use"]) == before


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_at_world_size_one_is_the_gradients(dtype, overlap):
    comm = AsyncComm()
    rt, _ = _runtime(comm, dtype=dtype, overlap=overlap)
    a = rt.units[0]
    torch.manual_seed(1)
    grads = [torch.randn(s).to(dtype) for s in a.shapes]  # any values: a copy is exact
    rt.units[1].slice_of(rt.local_grads).fill_(3.0)  # another unit's slice is not touched
    a.begin_backward(lambda p: True)
    a.gather()
    _set_grads(a, grads)
    a.reduce(lambda p: True)
    assert a.state is REDUCING and a.phase is GradPhase.REDUCED and rt.ctx.inflight is a
    assert all(p.grad is None for p in a.params)
    for p, shape in zip(a.params, a.shapes):
        assert _is_placeholder(rt, p, shape)
    rt.finish_reduce()
    assert a.state is SHARDED and rt.ctx.inflight is None and a.rs is None
    assert torch.equal(a.slice_of(rt.local_grads), _flat(a, grads))  # padding: zeros
    assert bool((rt.units[1].slice_of(rt.local_grads) == 3.0).all())
    assert rt.gather_arena.stats()["in_use"] == 0
    if overlap:
        assert [w.waited for w in comm.works] == [1, 1]  # the gather, then the reduce-scatter
    rt.finish_reduce()  # nothing in flight: nothing to do


def test_reduce_skips_unmanaged_and_missing_gradients():
    rt, _ = _runtime()
    a = rt.units[0]
    w, bias = a.params
    grads = _int_grads(a, 0, torch.float32)
    a.begin_backward(lambda p: p is w)
    a.gather()
    w.grad = grads[0].clone()
    bias.grad = grads[1].clone()  # in no optimizer: stays on .grad, as torch leaves it
    a.reduce(lambda p: p is w)
    rt.finish_reduce()
    assert torch.equal(a.slice_of(rt.local_grads), _flat(a, [grads[0], torch.zeros_like(bias)]))
    assert torch.equal(bias.grad, grads[1]) and w.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_again_adds_to_the_slice(dtype):
    rt, _ = _runtime(dtype=dtype)
    a = rt.units[0]
    every = lambda p: True  # noqa: E731
    g1, g2, g3 = (_int_grads(a, s, dtype) for s in (1, 2, 3))
    for grads in (g1, g2, g3):  # one backward, then two more of the same step
        a.begin_backward(every)
        a.gather()
        _set_grads(a, grads)
        a.reduce(every)
    rt.finish_reduce()
    want = sum(_flat(a, g).double() for g in (g1, g2, g3))
    assert torch.equal(a.slice_of(rt.local_grads), want.to(dtype))
    assert torch.equal(a.slice_of(rt.local_grads),
                       _flat(a, g1) + _flat(a, g2) + _flat(a, g3))
    a.new_step()  # the next step writes again
    a.begin_backward(every)
    _set_grads(a, g1)
    a.reduce(every)
    rt.finish_reduce()
    assert torch.equal(a.slice_of(rt.local_grads), _flat(a, g1))


def test_regather_of_a_reducing_unit_finishes_its_reduce_first():
    rt, _ = _runtime(AsyncComm(), overlap=True)
    a = rt.units[0]
    grads = _int_grads(a, 4, torch.float32)
    a.begin_backward(lambda p: True)
    a.gather()
    _set_grads(a, grads)
    a.reduce(lambda p: True)
    assert a.state is REDUCING
    a.gather()
    assert a.state is GATHERED and rt.ctx.inflight is None
    assert torch.equal(a.slice_of(rt.local_grads), _flat(a, grads))


class _Sink:
    """Stands in for the offloading optimizer's OffloadPipeline: lands each unit's averaged
    slice (copy, or add in a further backward) and records what it was given."""

    def __init__(self) -> None:
        self.landed: list[tuple[int, bool]] = []

    def land(self, c, src, dst, accumulate):
        self.landed.append((c, accumulate))
        dst.add_(src) if accumulate else dst.copy_(src)
        return Ticket()

    def drain(self) -> None:
        pass


def test_offloaded_gradients_land_through_the_sink():
    rt, _ = _runtime()
    sink = _Sink()
    rt.offload_grads(sink)
    assert rt.grads_on_host and rt.grad_sink is sink
    a = rt.units[0]
    every = lambda p: True  # noqa: E731
    g1, g2 = _int_grads(a, 5, torch.float32), _int_grads(a, 6, torch.float32)
    for grads in (g1, g2):
        a.begin_backward(every)
        a.gather()
        _set_grads(a, grads)
        a.reduce(every)
        rt.finish_reduce()
    assert sink.landed == [(0, False), (0, True)]
    assert torch.equal(a.slice_of(rt.local_grads), _flat(a, g1) + _flat(a, g2))


# -- the runtime's pieces -----------------------------------------------------------------------
def test_forward_order_and_prefetch_choice():
    order = ForwardOrder(roots={9})
    order.start()
    for i in (9, 0, 1, 2):
        order.ran(i)
        assert order.forward_prefetch(2) == []  # nothing to follow in the first forward
    order.start()
    order.ran(9)
    assert order.forward_prefetch(2) == [0, 1]
    order.ran(0)
    assert order.forward_prefetch(1) == [1] and order.forward_prefetch(0) == []
    order.ran(2)  # diverged (1 skipped): gathered on demand from now on
    assert order.forward_prefetch(2) == []
    order.current = [9, 0, 1, 0, 2]
    assert order.backward_prefetch(2, 2) == [0, 1]  # distinct, nearest first, no root
    assert order.backward_prefetch(0, 5) == [1, 0]
    assert order.backward_prefetch(7, 2) == [] and order.last_pos(0) == 3
    order.abort()
    order.start()
    assert order.previous == [9, 0, 1, 2]  # a forward that raised is not followed


def test_gather_arena_holds_root_prefetch_and_one_gradient_buffer():
    want = (10 + (8 + 6) + 8) * 4 + GATHER_ALIGN * 5
    assert gather_arena_bytes([10], [6, 8, 2], prefetch=1, element_size=4) == want
    assert gather_arena_bytes([10], [], prefetch=0, element_size=2) == 20 * 2 + GATHER_ALIGN * 4


# -- whole forward and backward, and the saved tensors ------------------------------------------
def test_saved_tensor_is_repointed_into_the_units_new_buffer():
    rt, values = _runtime()
    a, b, _ = rt.units
    hooks = rt._saved_hooks  # noqa: SLF001 - the runtime's own helper
    a.gather()
    view = a.params[0].t()  # what a linear layer saves for its backward
    packed = hooks.pack(view)
    assert isinstance(packed, tuple) and packed[0] is _GatheredRef and packed[1] == a.index
    other = torch.randn(3)
    assert hooks.pack(other) is other and hooks.pack(view.double()) is not packed
    old = a.block.offset
    a.release()
    b.gather()  # takes the block a had
    a.gather()
    assert a.block.offset != old
    got = hooks.unpack(packed)
    want = values[id(a.params[0])].t()
    assert torch.equal(got, want) and got.stride() == want.stride()
    assert hooks.unpack(other) is other


@pytest.mark.parametrize("checkpoint", [False, True])
def test_backward_reduces_the_same_gradients_as_an_unsharded_model(checkpoint):
    """Forward gathers with prefetch, saved tensors, backward re-gathers and reduce at world
    size 1, and a unit skipped in a step (its slice zeroed at the step): the slices hold
    torch's own gradients, bitwise."""
    torch.manual_seed(0)
    ref = TinyGPT(checkpoint=checkpoint)
    model = zerokern.shard_model(copy.deepcopy(ref), unit_classes=(Block,), prefetch=1)
    rt = runtime_of_module(model)
    for step, skip in enumerate((None, 1)):  # block 1 unused in the second step
        x, y = batch(step, 0)
        F.cross_entropy(model(x, skip), y).backward()
        F.cross_entropy(ref(x, skip), y).backward()
        assert not any(u.gathered or u.in_backward for u in rt.units)
        assert not rt._saved_hooks.active  # noqa: SLF001
        rt.prepare_step()
        grads = dict(zip((id(p) for p in model.parameters()), ref.parameters()))
        for u in rt.units:
            assert u.phase is (GradPhase.IDLE if u.index == skip else GradPhase.REDUCED)
            assert u.state is SHARDED
            want = _flat(u, [g.grad if g.grad is not None else torch.zeros_like(g)
                             for g in (grads[id(p)] for p in u.params)])
            assert torch.equal(u.slice_of(rt.local_grads), want)
        rt.new_step()
        ref.zero_grad()
    assert rt.peak_units <= 2 and rt.overflow_bytes == 0
