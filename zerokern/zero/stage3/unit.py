"""How ZeRO stage 3 works: one unit's lifecycle, and a training step through it.

``shard_model(model, unit_classes=(Block,))`` cuts the model into units: each module of
``unit_classes`` (outermost matches, typically the transformer blocks), and the root, which
keeps the parameters left over (tied ones included). A unit owns one padded flat space of its
parameters (plan.py); this rank keeps the contiguous 1/N slice of every unit in
``local_params`` and the matching gradient slice in ``local_grads`` (context.py). Outside its
use a parameter keeps its shape, dtype and device but holds no memory: a zero-stride view of
one NaN, so a read outside a forward is NaN and a write raises.

A unit moves along two axes; each move is a named method of ``Unit`` (below), and every move
is checked against its machine's table (states.py), which refuses one it does not list with
IllegalTransition naming both states. Storage (``UnitState``, where the parameters are)::

    SHARDED --gather--> GATHERING --gather (wait)--> GATHERED --release--> SHARDED
    GATHERING --release--> SHARDED  (prefetched, never used)
    GATHERED --reduce--> REDUCING --finish_reduce--> SHARDED
    SHARDED --reduce--> REDUCING  (no buffer held: its gradients are on .grad)

Gradients of this step (``GradPhase``)::

    IDLE --begin_backward--> BACKWARD --end_backward--> REDUCED (no_sync: back to IDLE)
    REDUCED --begin_backward--> BACKWARD_AGAIN --end_backward--> REDUCED
    new_step: REDUCED -> IDLE, BACKWARD_AGAIN -> BACKWARD

One step (runtime.py drives it from module and autograd hooks):

1. Forward. The root's pre-forward hook gathers the root (held through the whole forward)
   and enters the saved-tensor hooks. Each unit's pre-forward hook gathers it: a buffer from
   the gather arena, this rank's slice all-gathered into it, the parameters rebound as views
   of it; the next ``prefetch`` units of the previous forward's order start their gathers
   (GATHERING: overlapping this unit's compute; order.py). Its post-forward hook hooks its
   outputs (their gradients will begin its backward) and releases it (with
   ``reshard_after_forward``, and under no_grad): the buffer returns to the arena, the
   parameters become placeholders. At the root's end whatever was prefetched but not run is
   released: at most ``prefetch`` + 1 units besides the root are ever gathered.
2. Saved tensors. Autograd keeps views of gathered parameters (``weight.t()``) for backward,
   but a released buffer is reused by the next unit: while the root's forward runs they are
   packed as (unit, offset, shape, stride) and unpacked against wherever the unit is gathered
   when backward needs them, gathering it if need be (saved.py).
3. Backward. The first gradient of a unit's output begins its backward: it is gathered again
   and the units before it in the forward order are prefetched. Each parameter's gradient is
   marked arrived once accumulated; when none is due the unit reduces: its gradients are
   flattened into an arena buffer (cast into the reduce dtype) and reduce-scattered
   asynchronously into its slice of ``local_grads`` by the context's reduce part
   (comm/parts.py), ``.grad`` is freed, its buffer released (GATHERED -> REDUCING). One
   reduce-scatter is in flight at a time, overlapping the backward of the units before; the
   next reduce (or the end of the backward) finishes it (REDUCING -> SHARDED): averaged (the
   one division by N of every stage) and, in a further backward of the same step
   (BACKWARD_AGAIN), added to the slice. Activation
   checkpointing's recompute gathers into buffers of their own, not the arena's (it saves
   views of them), and the root stays gathered through its reduce (recompute.py).
4. End of backward (a callback queued on autograd's engine). Units whose gradients did not
   all arrive (unused parameters) reduce too, in the same order on every rank, with zeros for
   what did not come; everything still gathered is released; the optimizer's callbacks run.
   Under ``no_sync`` nothing is reduced: gradients accumulate on the parameters until a
   synchronised backward, or the step, reduces them.
5. Step (the optimizer side, engine.py). ``prepare_step`` reduces what no_sync left and
   zeroes the slices of units that received nothing; the fused AdamW runs over this rank's
   slices only (fp32 master and moments; the new 16-bit values written into ``local_params``),
   so nothing is gathered after the step: the next forward gathers the new slices.
   ``new_step`` opens the next step's gradient phases.

Offload. With ``offload_params`` ``local_params`` lives in host memory (pinned on CUDA): gather
first copies this rank's slice into its part of the buffer (ordered before the in-place
all-gather), release waits for that copy (the step may then write the host slice). With an
offloading optimizer (``offload="cpu"``, which attaches its OffloadPipeline) ``local_grads``
lives in host memory: reduce scatters in place in the gradient buffer, and finish_reduce lands
the averaged slice on the host through the pipeline's staging slots (zero/offload.py).

Hybrid sharding (a 2-D mesh): gathers and reduce-scatters stay within the shard group; the
reduce part then sums the slice across the replicate group asynchronously (overlapping the
next unit's reduce-scatter) and averages it by S * R. With ``reduce_dtype`` the gradient buffer
and ``local_grads`` are in that dtype, cast as the gradients are flattened.

A wait in a unit's collective beyond ``gather_timeout`` breaks the context: CollectiveTimeout
names the unit and the likely cause, buffers a pending collective may still write never return
to the arena, and every later gather refuses (gather_timeout.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ...memory import Block
from ..offload import Ticket
from ..plan import UnitPlan
from .adopt import adopt
from .context import UnitContext
from .states import HOLDS_BUFFER, IN_BACKWARD, GradPhase, UnitState, check_move, illegal
from .views import alias_frozen, bind, placeholders

# Appended to the label of a unit's gather: in an error (a peer died, or timed out because it
# is not running this forward) it says the likely cause.
_COLLECTIVE_HINT = (" (stage 3: every forward, model.state_dict() and full_state_dict() gather "
                    "from all ranks; run them on every rank, not under `if rank == 0`)")


class _Reduce(NamedTuple):
    """A reduce-scatter in flight: its handle (None: already done), this unit's slice of
    local_grads, where the sum lands, whether it adds to the slice, and its arena block."""

    work: Any
    shard: torch.Tensor
    out: torch.Tensor
    accumulate: bool
    block: Block | None


@dataclass(eq=False)
class Unit:
    """One unit of a sharded model: its parameters, their plan, this rank's place in the
    slices, and its two states. Its verbs: gather / release / reduce / finish_reduce
    (storage), begin_backward / grad_arrived / end_backward / new_step (gradients)."""

    index: int
    name: str
    module: torch.nn.Module = field(repr=False)
    params: list[torch.nn.Parameter] = field(repr=False)
    shapes: list[torch.Size] = field(repr=False)
    plan: UnitPlan = field(repr=False)
    shard_start: int  # offset of this rank's slice in local_params / local_grads
    ctx: UnitContext = field(repr=False)
    is_root: bool = False
    state: UnitState = UnitState.SHARDED
    phase: GradPhase = GradPhase.IDLE
    buf: torch.Tensor | None = field(default=None, repr=False)  # gathered full flat buffer
    block: Block | None = field(default=None, repr=False)  # its gather-arena block
    work: Any = field(default=None, repr=False)  # in-flight async all-gather
    h2d: Ticket | None = field(default=None, repr=False)  # offload_params: slice -> device
    rs: _Reduce | None = field(default=None, repr=False)  # its reduce-scatter in flight
    waiting: set[int] = field(default_factory=set, repr=False)  # params whose grads are due
    # Where its parameters are registered (module, name, index in params), and whether the
    # frozen ones are presented there as aliases of an own buffer now (gather(own=True)).
    slots: list[tuple[torch.nn.Module, str, int]] = field(default_factory=list, repr=False)
    aliased: bool = False

    @property
    def gathered(self) -> bool:
        """Whether it holds a gather buffer (GATHERING or GATHERED)."""
        return self.state in HOLDS_BUFFER

    @property
    def in_backward(self) -> bool:
        """Whether its backward runs in this step (BACKWARD or BACKWARD_AGAIN)."""
        return self.phase in IN_BACKWARD

    def slice_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This unit's part of a rank-local flat tensor (local_params, local_grads)."""
        return flat.narrow(0, self.shard_start, self.plan.shard_numel)

    # -- storage: SHARDED -> GATHERING -> GATHERED -> SHARDED | REDUCING -> SHARDED ----------
    def take_shard(self, full: torch.Tensor) -> None:
        """Setup: keep this rank's slice of the full flat values ``full`` and release the
        parameters (they become placeholders: SHARDED)."""
        if self.state is not UnitState.SHARDED:
            raise illegal(self.name, "take_shard", self.state, "SHARDED")
        s = self.plan.shard_numel
        self.slice_of(self.ctx.local_params).copy_(full.narrow(0, self.ctx.comm.rank * s, s))
        placeholders(self)

    def gather(self, *, wait: bool = True, own: bool = False) -> None:
        """SHARDED -> GATHERING (GATHERED when the gather completed at once), and with
        ``wait`` on to GATHERED. A released unit first takes values assigned to its
        placeholders (adopt.py); a REDUCING one first finishes its reduce-scatter.

        ``own`` (for a recompute in the backward): the buffer is an allocation of its own,
        never an arena block (one gathered in the arena is copied out of it), and the modules
        see each frozen parameter as a detached alias of it. Tensors a recompute saves from
        it (views, or a frozen parameter itself) then keep their values however long they
        live: the release drops the unit's references only, and the memory never goes to
        another unit (recompute.py)."""
        ctx = self.ctx
        ctx.check_usable()
        if self.state is UnitState.REDUCING:
            ctx.finish_scatter()  # one buffer per unit at a time; the reduce is the one in flight
        if self.state is UnitState.SHARDED:
            adopt(self)
            if own:
                buf, blk = torch.empty(self.plan.padded_numel, dtype=ctx.dtype,
                                       device=ctx.device), None
            else:
                buf, blk = ctx.alloc(self.plan.padded_numel)
            self.buf, self.block = buf, blk
            self._move(UnitState.GATHERING)  # from here a release gives the buffer back
            src = self.slice_of(ctx.local_params)
            if ctx.copier is not None:
                # Offloaded slice: to the device, into this rank's part of the gather buffer,
                # then gathered in place (the gather is ordered after the copy on the device).
                s = self.plan.shard_numel
                mine = buf.narrow(0, ctx.comm.rank * s, s)
                self.h2d = ctx.copier.to_device(mine, src)
                self.h2d.fence()
                src = mine
            label = f"parameters of unit {self.name}{_COLLECTIVE_HINT}"
            sec = ctx.secondary  # hpZ: after the forward's gather, within the node (secondary.py)
            if sec is not None and sec.holds(self):
                self.work = sec.gather(self, buf, label, async_op=ctx.overlap)
            else:
                if sec is not None:
                    sec.will_fill(self)
                self.work = ctx.param_comm.gather(buf, src, label, async_op=ctx.overlap)
            bind(self, buf)
            if own:
                alias_frozen(self)
            if self.work is None:  # done at once (world size 1, or a synchronous group)
                self._move(UnitState.GATHERED)
        if (wait or own and self.block is not None) and self.state is UnitState.GATHERING:
            if self.work is not None:
                ctx.wait(self.work, self.name, "all-gather of the parameters")
                self.work = None
            self._move(UnitState.GATHERED)
        if own and self.block is not None:
            self.leave_arena()

    def release(self) -> None:
        """GATHERING | GATHERED -> SHARDED: the buffer returns to the arena and the parameters
        become placeholders. Nothing to do when it holds no buffer (as FSDP2's reshard)."""
        if not self.gathered:
            return
        self._give_back()
        self._move(UnitState.SHARDED)

    def _give_back(self) -> None:
        """The gather buffer back to the arena (once its gather and host copy are done), the
        parameters placeholders; the caller moves the state."""
        ctx = self.ctx
        if ctx.broken is not None and self.work is not None:
            self._abandon()
        if self.work is not None:
            ctx.wait(self.work, self.name, "all-gather of the parameters")
            self.work = None
        if self.h2d is not None:  # the host slice may be written (by the step) from now on
            self.h2d.wait()
            self.h2d = None
        # Use zerokern.full_state_dict(model) (or run the model) to see the values.
        placeholders(self)
        if self.block is not None:
            ctx.gather_arena.free(self.block)
        self.buf, self.block = None, None

    def reduce(self, reduces: Callable[[torch.nn.Parameter], bool], *,
               keep: bool = False) -> None:
        """In its backward, GATHERED -> REDUCING. The reduce-scatter in flight finishes
        first; then the gradients of the parameters ``reduces`` accepts (zeros for the
        others and the padding) are flattened (cast into the reduce dtype) and their
        reduce-scatter into this unit's slice started, .grad is freed, the phase ends
        (REDUCED), the buffer goes back. ``keep``: the unit stays GATHERED, its
        reduce-scatter in flight all the same (the root in a backward: a recompute may still
        read it; recompute.py)."""
        if not self.in_backward:
            raise illegal(self.name, "reduce", self.phase, "BACKWARD or BACKWARD_AGAIN")
        ctx = self.ctx
        # One reduce-scatter in flight at a time: it overlaps the backward of the units before
        # this one, and the gather arena holds a single gradient buffer.
        ctx.finish_scatter()
        grads = [(p, off) for p, off in zip(self.params, self.plan.param_offsets)
                 if p.grad is not None and reduces(p)]
        buf, blk = ctx.alloc(self.plan.padded_numel, ctx.grad_dtype)
        if len(grads) < len(self.params) or self.plan.padding:
            buf.zero_()  # params without a gradient on this rank, and the padding
        if grads:
            ctx.grad_comm.load(buf, [p.grad.detach().reshape(-1).contiguous() for p, _ in grads],
                               [off for _, off in grads])
        shard = self.slice_of(ctx.local_grads)
        accumulate = self.phase is GradPhase.BACKWARD_AGAIN
        if ctx.grad_sink is not None:  # in place: the host shard is filled by the sink
            s = self.plan.shard_numel
            out = buf.narrow(0, ctx.comm.rank * s, s)
        else:
            out = torch.empty_like(shard) if accumulate else shard
        work = ctx.grad_comm.reduce(out, buf, f"gradients of unit {self.name}",
                                    async_op=ctx.overlap)
        self.rs, ctx.inflight = _Reduce(work, shard, out, accumulate, blk), self
        for p, _ in grads:
            p.grad = None
        self.end_backward(reduced=True)
        if keep and self.gathered:
            return
        if self.state is UnitState.GATHERING and ctx.broken is None:
            self.gather()  # its all-gather waited for: GATHERED, then on as documented
        if self.gathered:
            self._give_back()
        self._move(UnitState.REDUCING)

    def finish_reduce(self) -> None:
        """REDUCING -> SHARDED: wait for its reduce-scatter and hand the sum to the reduce
        part, which completes it (across a mesh's replicas, asynchronously), averages it into
        the slice (or lands it on the host) and gives the gradient buffer back."""
        rs = self.rs
        if rs is None:
            raise illegal(self.name, "finish_reduce", self.state, "REDUCING")
        ctx = self.ctx
        self.rs, ctx.inflight = None, None
        if self.state is UnitState.REDUCING:  # else kept gathered, or its release raised
            self._move(UnitState.SHARDED)
        if rs.work is not None:
            if ctx.broken is not None:
                return  # its buffer stays out of the arena: the collective is pending
            ctx.wait(rs.work, self.name, "reduce-scatter of the gradients")
        sink = ctx.grad_sink  # offloaded: the sum is in the gradient buffer until landed

        def land() -> None:
            if sink is not None:
                # The gather buffer is reused once the copy out of it is done (device order).
                sink.land(self.index, rs.out, rs.shard, rs.accumulate).fence()
            elif rs.accumulate:
                rs.shard.add_(rs.out)
            if sink is not None and rs.block is not None:
                ctx.gather_arena.free(rs.block)

        ctx.grad_comm.complete(rs.out, f"gradients of unit {self.name}", land)
        if sink is not None:
            ctx.grad_comm.settle()  # the arena holds one gradient buffer: landed before reuse
        elif rs.block is not None:
            ctx.gather_arena.free(rs.block)  # the sum is in the slice (or its temporary)

    # -- gradients: IDLE -> BACKWARD -> REDUCED -> BACKWARD_AGAIN -> REDUCED ------------------
    def begin_backward(self, reduces: Callable[[torch.nn.Parameter], bool]) -> None:
        """IDLE -> BACKWARD, REDUCED -> BACKWARD_AGAIN: the gradients of its parameters that
        require one and that ``reduces`` accepts are due."""
        if self.phase is GradPhase.IDLE:
            self._set_phase(GradPhase.BACKWARD)
        elif self.phase is GradPhase.REDUCED:
            self._set_phase(GradPhase.BACKWARD_AGAIN)
        else:
            raise illegal(self.name, "begin_backward", self.phase, "IDLE or REDUCED")
        self.waiting = {j for j, p in enumerate(self.params) if p.requires_grad and reduces(p)}

    def grad_arrived(self, j: int) -> bool:
        """Parameter ``j``'s gradient is accumulated; whether none is due any more."""
        self.waiting.discard(j)
        return not self.waiting and self.in_backward

    def end_backward(self, reduced: bool) -> None:
        """BACKWARD | BACKWARD_AGAIN -> REDUCED when its gradients were reduced; without a
        reduction (no_sync: they stay on the parameters) BACKWARD -> IDLE and
        BACKWARD_AGAIN -> REDUCED (the slice keeps what the earlier backward reduced)."""
        if not self.in_backward:
            raise illegal(self.name, "end_backward", self.phase, "BACKWARD or BACKWARD_AGAIN")
        if reduced or self.phase is GradPhase.BACKWARD_AGAIN:
            self._set_phase(GradPhase.REDUCED)
        else:
            self._set_phase(GradPhase.IDLE)
        self.waiting = set()

    def new_step(self) -> None:
        """The step boundary: nothing is reduced in the new step yet (REDUCED -> IDLE,
        BACKWARD_AGAIN -> BACKWARD; a backward under way stays one)."""
        if self.phase is GradPhase.REDUCED:
            self._set_phase(GradPhase.IDLE)
        elif self.phase is GradPhase.BACKWARD_AGAIN:
            self._set_phase(GradPhase.BACKWARD)

    # -- helpers ---------------------------------------------------------------------------
    def _move(self, state: UnitState) -> None:
        """Set the storage state (a move the table allows: states.py), counting the non-root
        units that hold a gather buffer."""
        check_move(self.name, self.state, state)
        was = self.gathered
        self.state = state
        if state is UnitState.GATHERED and self.ctx.secondary is not None:
            self.ctx.secondary.gathered(self)
        if self.is_root or was == self.gathered:
            return
        ctx = self.ctx
        ctx.gathered_units += 1 if self.gathered else -1
        ctx.peak_units = max(ctx.peak_units, ctx.gathered_units)

    def _set_phase(self, phase: GradPhase) -> None:
        """Set the gradient phase (a move the table allows: states.py)."""
        check_move(self.name, self.phase, phase)
        self.phase = phase

    def leave_arena(self, *, retire: bool = False) -> None:
        """GATHERED in an arena block -> the same values in an allocation of its own; the
        block goes back to the arena (``retire``: at the end of the backward, for tensors
        saved from it until now: UnitContext.retired)."""
        if self.state is not UnitState.GATHERED or self.block is None:
            raise illegal(self.name, "leave_arena", self.state, "GATHERED in an arena block")
        assert self.buf is not None
        if self.h2d is not None:  # the host slice's copy is done before the buffer is read
            self.h2d.wait()
            self.h2d = None
        buf = self.buf.clone()
        bind(self, buf)
        alias_frozen(self)
        if retire:
            self.ctx.retired.append(self.block)
        else:
            self.ctx.gather_arena.free(self.block)
        self.buf, self.block = buf, None

    def _abandon(self) -> None:
        """After a timeout: a pending gather may still write the buffer, so it never goes
        back to the arena, and nothing waits on it again."""
        if self.buf is not None:
            self.ctx.abandoned.append(self.buf)
        self.block, self.work = None, None
