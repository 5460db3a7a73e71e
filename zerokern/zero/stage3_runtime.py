"""Stage-3 runtime: parameters partitioned per unit and gathered just in time.

Each unit (a module such as a transformer block, plus the root for the rest) owns one padded
flat space of its parameters; this rank stores the contiguous 1/N slice of it in
``local_params``. Before a unit runs (forward, or backward) its parameters are all-gathered
into a buffer from the gather arena and the parameters become views of it; afterwards they
are released (the buffer returns to the arena). When the unit's backward has produced all its
gradients they are flattened, reduce-scattered into ``local_grads`` and freed.

ZeRO-Offload: with ``offload_params`` the parameter slice lives in host memory and is copied
into this rank's slice of the gather buffer just before the unit's (in-place) all-gather;
once an offloading optimizer attached its pipeline (``offload_grads``), ``local_grads`` lives
in host memory and each unit's gradients are reduce-scattered in place into the gather buffer
and landed on the host through the pipeline's staging slots (zero/offload.py).

Tensors autograd saves from a gathered buffer are packed as references while the root's
forward runs (stage3_saved.py). The optimizer side of stage 3 is stages/stage3.py.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .. import ops
from ..comm import CollectiveTimeout, Comm
from ..memory import Arena, ArenaOutOfMemory, Block
from . import gather_timeout as told
from .interop import active_ddp_module
from .layout import ALIGN_ELEMS
from .offload import HOST, Copier, OffloadPipeline, Ticket, pin_host_memory
from .plan import UnitPlan, plan_units
from .rebind import changed_error
from .stage3_saved import SavedTensorHooks
from .stages.base import average_

# Appended to the label of a unit's gather: in an error (a peer died, or timed out because it
# is not running this forward) it says the likely cause.
_COLLECTIVE_HINT = (" (stage 3: every forward, model.state_dict() and full_state_dict() gather "
                    "from all ranks; run them on every rank, not under `if rank == 0`)")


class GradPhase(enum.Enum):
    """Where a unit is in the gradient side of the current step."""

    IDLE = "idle"  # no backward reached it in this step
    BACKWARD = "backward"  # its backward runs: gathered, gradients due
    REDUCED = "reduced"  # its gradients were reduce-scattered into the shard
    BACKWARD_AGAIN = "backward again"  # a further backward of the same step: adds to the shard


@dataclass(eq=False)
class Unit:
    index: int
    name: str
    module: torch.nn.Module
    params: list[torch.nn.Parameter]
    shapes: list[torch.Size]
    plan: UnitPlan
    shard_start: int  # offset of this rank's slice in local_params / local_grads
    is_root: bool = False
    buf: torch.Tensor | None = None  # gathered full flat buffer
    block: Block | None = None
    work: Any = None  # in-flight async all-gather
    h2d: Ticket | None = None  # offload_params: the host -> device copy of its slice
    phase: GradPhase = GradPhase.IDLE
    waiting: set[int] = field(default_factory=set)  # params whose grads are still due

    @property
    def gathered(self) -> bool:
        return self.buf is not None

    @property
    def in_backward(self) -> bool:
        return self.phase in (GradPhase.BACKWARD, GradPhase.BACKWARD_AGAIN)

    def start_backward(self, reduced: Callable[[torch.nn.Parameter], bool]) -> None:
        self.phase = (GradPhase.BACKWARD_AGAIN if self.phase is GradPhase.REDUCED
                      else GradPhase.BACKWARD)
        self.waiting = {j for j, p in enumerate(self.params) if p.requires_grad and reduced(p)}

    def end_backward(self, reduced: bool) -> None:
        """Its gradients were reduced, or (no_sync) are left on the parameters."""
        if reduced:
            self.phase = GradPhase.REDUCED
        else:
            self.phase = (GradPhase.REDUCED if self.phase is GradPhase.BACKWARD_AGAIN
                          else GradPhase.IDLE)
        self.waiting = set()


class Stage3Runtime:
    def __init__(
        self,
        root: torch.nn.Module,
        units: list[tuple[str, torch.nn.Module, list[torch.nn.Parameter]]],
        comm: Comm,
        *,
        prefetch: int,
        reshard_after_forward: bool,
        offload_params: bool = False,
        gather_timeout: tuple[float, bool] = (told.DEFAULT_S, False),
    ) -> None:
        self.root, self.comm = root, comm
        self.prefetch, self.reshard = prefetch, reshard_after_forward
        self.offload_params = offload_params
        # Bound on one wait in a unit's collective (gather_timeout.py); after a timeout the
        # runtime refuses to go on (``broken``): the timed-out collective is still pending.
        self.timeout_s = gather_timeout[0]
        self.wait_timeout = told.wait_limit(*gather_timeout, comm.backend)
        self.broken: str | None = None
        self._abandoned: list[torch.Tensor] = []  # buffers a pending collective may still write
        self._adopted: list[torch.nn.Parameter] = []  # given new values (rebind.py), for the master
        p0 = next(p for _, _, ps in units for p in ps)
        self.dtype, self.device = p0.dtype, p0.device
        plans = plan_units([[p.numel() for p in ps] for _, _, ps in units], comm.world_size,
                           ALIGN_ELEMS)
        self.units: list[Unit] = []
        start = 0
        for i, ((name, mod, ps), plan) in enumerate(zip(units, plans)):
            self.units.append(Unit(i, name, mod, ps, [p.shape for p in ps], plan, start,
                                   is_root=mod is root))
            start += plan.shard_numel
        self.local_numel = start
        esz = torch.empty(0, dtype=self.dtype).element_size()
        # Persistent model state of this rank: its slice of every unit (params and grads),
        # each in its own arena on the device, or in host memory when offloaded.
        self.param_arena, self.local_params = self._alloc_local(offload_params)
        self.grad_arena, self.local_grads = self._alloc_local(False)
        self.local_grads.zero_()
        self.grads_on_host = False
        self.grad_sink: OffloadPipeline | None = None  # the offloading optimizer's pipeline
        self.copier = Copier(self.device) if offload_params else None
        # Gather arena: the root (held through the whole forward) + prefetch+1 other units,
        # plus one gradient buffer for the unit being reduced.
        sizes = sorted((u.plan.padded_numel for u in self.units if not u.is_root), reverse=True)
        root_size = sum(u.plan.padded_numel for u in self.units if u.is_root)
        biggest = sizes[0] if sizes else root_size
        cap_elems = root_size + sum(sizes[: prefetch + 1]) + biggest
        align = 256
        self.gather_arena = Arena(cap_elems * esz + align * (prefetch + 4), self.device,
                                  alignment=align)
        self.overflow_bytes = 0
        self.peak_units = 0
        self.got_grad: dict[int, bool] = {}
        self.grad_events = 0  # gradients delivered by autograd hooks
        # Run at the end of every synchronised backward, after the reduction (ZeroAdamW puts
        # its GradGuards on the parameters' .grad).
        self.backward_end_callbacks: list[Any] = []
        self.param_names: dict[int, str] = {}
        self._ddp_checked: set[int] = set()
        self._hooked: set[int] = set()
        # The parameters of the optimizers built on this model (None: no optimizer yet, every
        # gradient is reduced). The others are plain leaves, as in torch: their gradients stay
        # on .grad and accumulate until zeroed, or until add_param_group makes them the
        # optimizer's (its first step then reduces the sum, as DDP would have averaged it).
        self._managed: set[int] | None = None
        # Released parameters keep their full shape, dtype and device (as FSDP2's DTensor
        # parameters do: shape-based param groups and parameter counts stay right) but hold no
        # memory: a zero-stride view of one NaN, so a value read outside a forward is NaN,
        # never a plausible number, and a write raises.
        self._nan = torch.full((), float("nan"), dtype=self.dtype, device=self.device)
        self.sync = True
        self.fwd_order: list[int] = []
        self.prev_order: list[int] = []
        self._saved_hooks = SavedTensorHooks(self)
        self._callback_task = -1  # the backward whose end-of-backward callback is queued
        self._inflight_rs: Any = None
        # Prefetched gathers run asynchronously on every backend (NCCL stream, gloo threads).
        self.overlap = comm.world_size > 1
        self._param_unit: dict[int, tuple[Unit, int]] = {}
        for u in self.units:
            for j, p in enumerate(u.params):
                self._param_unit[id(p)] = (u, j)

    def _alloc_local(self, on_host: bool) -> tuple[Arena, torch.Tensor]:
        esz = torch.empty(0, dtype=self.dtype).element_size()
        arena = Arena(max(self.local_numel * esz + 512, 512), HOST if on_host else self.device,
                      pin_memory=on_host and pin_host_memory(self.device))
        return arena, arena.alloc(self.local_numel, self.dtype).tensor

    def offload_grads(self, sink: OffloadPipeline) -> None:
        """ZeRO-Offload: the gradient slices move to host memory (a fresh, zeroed buffer: no
        step is in progress when an optimizer is built) and every unit's reduced gradients
        are landed there through ``sink``."""
        if not self.grads_on_host:
            self.grad_arena, self.local_grads = self._alloc_local(True)
            self.local_grads.zero_()
            self.grads_on_host = True
        self.grad_sink = sink

    # -- setup -------------------------------------------------------------------------------
    def shard_parameters(self) -> None:
        """Copy (rank 0's) full parameters into this rank's slices and release them."""
        with torch.no_grad():
            for u in self.units:
                full = torch.zeros(u.plan.padded_numel, dtype=self.dtype, device=self.device)
                for p, off, n in zip(u.params, u.plan.param_offsets, u.plan.numels):
                    full.narrow(0, off, n).copy_(p.detach().reshape(-1))
                self.comm.broadcast(full, 0, f"initial parameters of unit {u.name}")
                s = u.plan.shard_numel
                self.local_shard(u, self.local_params).copy_(
                    full.narrow(0, self.comm.rank * s, s))
                self._release(u)
        self.comm.reset_stats()

    def local_shard(self, u: Unit, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(0, u.shard_start, u.plan.shard_numel)

    def install_hooks(self) -> None:
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out))
            if u.is_root:
                # Runs even when the forward raised (after the hook above otherwise): then
                # nothing stays gathered and the saved-tensor hooks are removed.
                u.module.register_forward_hook(self._after_root_forward, always_call=True)
        self._hook_grads([p for u in self.units for p in u.params if p.requires_grad])

    def hook_params(self, params: list[torch.nn.Parameter]) -> None:
        """An optimizer's parameters (at its construction, and those of its
        add_param_group): their gradients are reduced into the slices from now on."""
        self._hook_grads(params)
        if self._managed is None:
            self._managed = set()
        self._managed.update(id(p) for p in params)

    def _reduces(self, p: torch.nn.Parameter) -> bool:
        return self._managed is None or id(p) in self._managed

    def _hook_grads(self, params: list[torch.nn.Parameter]) -> None:
        # Once each: a parameter frozen at shard_model time and added later comes here too.
        for p in params:
            if id(p) in self._hooked:
                continue
            u, j = self._param_unit[id(p)]
            p.register_post_accumulate_grad_hook(lambda _p, u=u, j=j: self._on_grad(u, j))
            self._hooked.add(id(p))

    # -- gather / release --------------------------------------------------------------------
    def _alloc(self, numel: int) -> tuple[torch.Tensor, Block | None]:
        try:
            blk = self.gather_arena.alloc(numel, self.dtype)
            return blk.tensor, blk
        except ArenaOutOfMemory:
            # Unusual call orders can need more at once; allowed, and counted in the stats.
            self.overflow_bytes += numel * torch.empty(0, dtype=self.dtype).element_size()
            return torch.empty(numel, dtype=self.dtype, device=self.device), None

    def gather(self, u: Unit, *, wait: bool = True) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if not u.gathered:
            self._adopt(u)
            buf, blk = self._alloc(u.plan.padded_numel)
            u.buf, u.block = buf, blk
            src = self.local_shard(u, self.local_params)
            if self.copier is not None:
                # Offloaded slice: to the device, into this rank's part of the gather buffer,
                # then gathered in place (the gather is ordered after the copy on the device).
                s = u.plan.shard_numel
                own = buf.narrow(0, self.comm.rank * s, s)
                u.h2d = self.copier.to_device(own, src)
                u.h2d.fence()
                src = own
            u.work = self.comm.all_gather(buf, src,
                                          f"parameters of unit {u.name}{_COLLECTIVE_HINT}",
                                          async_op=self.overlap)
            for p, shape, off, n in zip(u.params, u.shapes, u.plan.param_offsets, u.plan.numels):
                p.data = buf.narrow(0, off, n).view(shape)
            self.peak_units = max(self.peak_units,
                                  sum(x.gathered for x in self.units if not x.is_root))
        if wait and u.work is not None:
            self._wait(u.work, u, "all-gather of the parameters")
            u.work = None

    def _wait(self, work: Any, u: Unit, what: str) -> None:
        """Wait for a unit's collective, at most ``wait_timeout`` seconds (gather_timeout.py)."""
        try:
            work.wait(timeout=self.wait_timeout)
        except CollectiveTimeout as exc:
            self.broken = told.message(self.comm.rank, self.comm.world_size, what, u.name,
                                       exc.waited, self.timeout_s)
            raise CollectiveTimeout(self.broken, exc.waited) from exc

    def _abandon(self, u: Unit) -> None:
        """After a timeout: a pending gather may still write ``u``'s buffer, so it never goes
        back to the arena, and nothing waits on it again."""
        if u.buf is not None:
            self._abandoned.append(u.buf)
        u.block, u.work = None, None

    def _release(self, u: Unit) -> None:
        if self.broken is not None and u.work is not None:
            self._abandon(u)
        if u.work is not None:
            self._wait(u.work, u, "all-gather of the parameters")
            u.work = None
        if u.h2d is not None:  # the host slice may be written (by the step) from now on
            u.h2d.wait()
            u.h2d = None
        for p, shape in zip(u.params, u.shapes):
            # Use zerokern.full_state_dict(model) (or run the model) to see the values.
            p.data = self._nan.expand(shape)
        if u.block is not None:
            self.gather_arena.free(u.block)
        u.buf, u.block = None, None

    def release(self, u: Unit) -> None:
        if u.gathered:
            self._release(u)

    # -- forward -----------------------------------------------------------------------------
    def _pre_forward(self, u: Unit) -> None:
        if u.is_root:
            self._check_not_in_ddp()
        if u.is_root and not u.in_backward:
            self.prev_order, self.fwd_order = self.fwd_order or self.prev_order, []
            if torch.is_grad_enabled():
                self._saved_hooks.enter()
        self.gather(u)
        if not u.in_backward:
            self.fwd_order.append(u.index)
            self._prefetch_forward()

    def _check_not_in_ddp(self) -> None:
        ddp = active_ddp_module()
        if ddp is None or id(ddp) in self._ddp_checked:
            return
        if any(m is self.root for m in ddp.module.modules()):
            raise RuntimeError(
                "shard_model: the sharded model runs inside torch DistributedDataParallel. "
                "ZeroAdamW(stage=3) reduces its gradients itself; remove the DDP(...) wrapper")
        self._ddp_checked.add(id(ddp))

    def _prefetch_forward(self) -> None:
        # Follow the previous step's order; if this step diverges, the extra gathers are
        # released at the end of the forward and units fall back to on-demand gathering.
        k = len(self.fwd_order)
        if self.prefetch <= 0 or self.fwd_order[: k] != self.prev_order[: k]:
            return
        for i in self.prev_order[k : k + self.prefetch]:
            nxt = self.units[i]
            if not nxt.gathered and not nxt.is_root:
                self.gather(nxt, wait=False)

    def _post_forward(self, u: Unit, out: Any) -> Any:
        grad_mode = torch.is_grad_enabled()
        if grad_mode and not u.in_backward:
            tensors = [t for t in tree_flatten(out)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(lambda g, u=u: self.pre_backward(u, g))
        if u.is_root and not u.in_backward:
            self._saved_hooks.exit()
            for other in self.units:  # prefetched but never run this time
                if other.gathered and not other.in_backward and other is not u:
                    self._release(other)
        if u.in_backward:
            return out  # recompute under activation checkpointing: keep it for the backward
        if self.reshard or not grad_mode or u.is_root:
            self._release(u)
        return out

    def _after_root_forward(self, module: Any, args: Any, out: Any) -> None:
        if not (out is None and sys.exc_info()[0] is not None):
            return  # the forward returned: _post_forward has done everything
        self._saved_hooks.exit()
        for u in self.units:
            if u.gathered and not u.in_backward:
                self._release(u)
        self.fwd_order = []

    # -- backward ----------------------------------------------------------------------------
    def pre_backward(self, u: Unit, grad: torch.Tensor | None) -> torch.Tensor | None:
        task = torch._C._current_graph_task_id()
        if task != self._callback_task:  # per backward: one that raised never ran its own
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_task = task
        if not u.in_backward:
            u.start_backward(self._reduces)
            self.gather(u)
            self._prefetch_backward(u)
        return grad

    def _prefetch_backward(self, u: Unit) -> None:
        if self.prefetch <= 0 or u.index not in self.fwd_order:
            return
        pos = len(self.fwd_order) - 1 - self.fwd_order[::-1].index(u.index)
        todo = [i for i in reversed(self.fwd_order[:pos]) if not self.units[i].is_root]
        seen: list[int] = []
        for i in todo:
            if i not in seen:
                seen.append(i)
            if len(seen) == self.prefetch:
                break
        for i in seen:
            nxt = self.units[i]
            if not nxt.gathered and not nxt.in_backward:
                self.gather(nxt, wait=False)

    def _on_grad(self, u: Unit, j: int) -> None:
        p = u.params[j]
        if not self._reduces(p):
            return  # in no optimizer: its .grad accumulates, as torch's does
        self.grad_events += 1
        if p.grad is not None and p.grad.layout != torch.strided:
            raise TypeError(f"ZeroAdamW: parameter {self.param_names.get(id(p), j)} got a "
                            f"{p.grad.layout} gradient; sparse gradients are not supported")
        self.got_grad[id(p)] = True
        if not self.sync:
            return  # no_sync: gradients accumulate on the parameters until the last micro-batch
        if not u.in_backward:  # its output hook did not fire (output not seen by autograd)
            self.pre_backward(u, None)
        u.waiting.discard(j)
        if not u.waiting and u.in_backward:
            self._reduce(u)

    def _reduce(self, u: Unit) -> None:
        # One reduce-scatter in flight at a time: it overlaps the backward of the units before
        # this one, and the gather arena holds a single gradient buffer.
        self.finish_reduce()
        grads = [(p, off) for p, off in zip(u.params, u.plan.param_offsets)
                 if p.grad is not None and self._reduces(p)]
        buf, blk = self._alloc(u.plan.padded_numel)
        if len(grads) < len(u.params) or u.plan.padding:
            buf.zero_()  # params without a gradient on this rank, and the padding
        if grads:
            ops.flatten_into_([p.grad.detach().reshape(-1).contiguous() for p, _ in grads], buf,
                              [off for _, off in grads])
        shard = self.local_shard(u, self.local_grads)
        accumulate = u.phase is GradPhase.BACKWARD_AGAIN
        if self.grad_sink is not None:  # in place: the host shard is filled by the sink
            s = u.plan.shard_numel
            out = buf.narrow(0, self.comm.rank * s, s)
        else:
            out = torch.empty_like(shard) if accumulate else shard
        work = self.comm.reduce_scatter(out, buf, f"gradients of unit {u.name}",
                                        async_op=self.overlap)
        self._inflight_rs = (u.index, work, shard, out, accumulate, blk)
        for p, _ in grads:
            p.grad = None
        u.end_backward(reduced=True)
        self.release(u)

    def finish_reduce(self) -> None:
        """Complete the reduce-scatter in flight (if any): average it into the gradient
        shard and give its buffer back."""
        if self._inflight_rs is None:
            return
        ui, work, shard, out, accumulate, blk = self._inflight_rs
        self._inflight_rs = None
        if work is not None:
            if self.broken is not None:
                return  # its buffer stays out of the arena: the collective is pending
            self._wait(work, self.units[ui], "reduce-scatter of the gradients")
        average_(out, self.comm)
        if self.grad_sink is not None:
            # The gather buffer is reused once the copy out of it is done (device order).
            self.grad_sink.land(ui, out, shard, accumulate).fence()
        elif accumulate:
            shard.add_(out)
        if blk is not None:
            self.gather_arena.free(blk)

    def _end_of_backward(self) -> None:
        """Units whose gradients did not all arrive (unused parameters) are reduced with zeros
        in a fixed order, the same on every rank; everything still gathered is released."""
        pending = [u for u in self.units if u.in_backward]
        for u in sorted(pending, key=lambda x: -self._last_pos(x)):
            if self.sync:
                self._reduce(u)
            else:
                u.end_backward(reduced=False)
        self.finish_reduce()
        for u in self.units:
            self.release(u)
        if self.sync:
            for cb in self.backward_end_callbacks:
                cb()

    def _last_pos(self, u: Unit) -> int:
        if u.index not in self.fwd_order:
            return -1
        return len(self.fwd_order) - 1 - self.fwd_order[::-1].index(u.index)

    def flush_no_sync(self) -> None:
        """After a no_sync accumulation finished with a synced backward, nothing is left;
        if the user steps right after no_sync backwards, reduce what the params hold."""
        for u in self.units:
            if any(p.grad is not None and self._reduces(p) for p in u.params):
                for p in u.params:  # set by hand, or left by no_sync: used as torch does
                    if p.grad is not None and self._reduces(p):
                        self.got_grad[id(p)] = True
                u.start_backward(self._reduces)
                self.gather(u)
                self._reduce(u)
        self.finish_reduce()

    def _adopt(self, u: Unit) -> None:
        """A released parameter whose ``.data`` was replaced (``p.data = t``; rebind.py):
        this rank's slices take ``t``'s values, as torch would train ``t``; another dtype,
        device or shape (``model.to(torch.bfloat16)``) is refused before anything changes."""
        nan = self._nan.data_ptr()
        for j, p in enumerate(u.params):
            if p.data_ptr() == nan or u.plan.numels[j] == 0:
                continue
            if p.dtype != self.dtype or p.device != self.device or p.shape != u.shapes[j]:
                raise changed_error("shard_model", f"parameter {self.param_names.get(id(p), j)!r}",
                                    p, self.dtype, self.device, u.shapes[j], "shard_model")
        for j, p in enumerate(u.params):
            if p.data_ptr() == nan or u.plan.numels[j] == 0:
                continue
            if bool(torch.isnan(p.detach()).all()):
                # The placeholder itself, copied by a conversion that materialises it
                # (Accelerate's prepare of a sharded model does): nothing was assigned.
                p.data = self._nan.expand(u.shapes[j])
                continue
            # Through .data: local_params' version counter (ZeroAdamW's sign of weights
            # written into the model) stays; the optimizer takes these via take_adopted().
            flat = p.detach().reshape(-1)
            for sp in u.plan.rank_pieces(self.comm.rank):
                if sp.param_index == j:
                    self.local_params.data.narrow(0, u.shard_start + sp.local_offset,
                                                  sp.numel).copy_(
                        flat[sp.param_offset : sp.param_offset + sp.numel])
            p.data = self._nan.expand(u.shapes[j])
            self._adopted.append(p)

    def adopt_assigned(self) -> None:
        """_adopt for every released unit (at a step: no gather since the assignment)."""
        for u in self.units:
            if not u.gathered:
                self._adopt(u)

    def take_adopted(self) -> list[torch.nn.Parameter]:
        out, self._adopted = self._adopted, []
        return out

    def shape_of(self, p: torch.nn.Parameter) -> torch.Size:
        u, j = self._param_unit[id(p)]
        return u.shapes[j]

    def prepare_step(self) -> None:
        """Before the optimizer step: gradients left by no_sync backwards are reduced now,
        and slices of units that received nothing this step are zeroed (stale otherwise)."""
        self.flush_no_sync()
        if self.grad_sink is not None:
            self.grad_sink.drain()  # every landed gradient is in local_grads
        for u in self.units:
            if u.phase is not GradPhase.REDUCED:
                self.local_shard(u, self.local_grads).zero_()

    def new_step(self) -> None:
        for u in self.units:  # nothing reduced in the new step yet
            if u.phase is GradPhase.REDUCED:
                u.phase = GradPhase.IDLE
            elif u.phase is GradPhase.BACKWARD_AGAIN:
                u.phase = GradPhase.BACKWARD
        self.got_grad = {}

    def local_pieces(self) -> list[tuple[torch.nn.Parameter, int, int, torch.Tensor]]:
        """This rank's pieces of every parameter, frozen ones included: (parameter, first
        element, numel, writable view of the stored slice)."""
        out = []
        for u in self.units:
            for sp in u.plan.rank_pieces(self.comm.rank):
                out.append((u.params[sp.param_index], sp.param_offset, sp.numel,
                            self.local_params.narrow(0, u.shard_start + sp.local_offset,
                                                     sp.numel)))
        return out

    # -- introspection -----------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        esz = self.local_params.element_size()
        a = self.gather_arena.stats()
        return {
            "local_params": self.local_numel * esz,
            "local_grads": self.local_numel * esz,
            "local_params_on_host": int(self.offload_params),
            "local_grads_on_host": int(self.grads_on_host),
            "gather_capacity": int(a["capacity"]),
            "gather_in_use": int(a["in_use"]),
            "gather_peak": int(a["peak_in_use"]),
            "gather_overflow": self.overflow_bytes,
            "peak_gathered_units": self.peak_units,
        }
