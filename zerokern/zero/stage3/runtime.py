"""Stage3Runtime: the hooks that move a sharded model's units (unit.py tells the whole story).

It builds the units and their context, and turns module and autograd events into unit
transitions, as FSDP2's FSDPState hooks drive its FSDPParamGroup: forward pre/post hooks
(gather, prefetch in the previous forward's order, release), hooks on a unit's output tensors
(its backward begins: pre_backward), post-accumulate-grad hooks (a gradient arrived; the unit
reduces when none is due), the end-of-backward callback (once per backward: activation
checkpointing's recompute and nested backwards, recompute.py), the no_sync flush, ``p.data =
t`` adoption, and the step seam the optimizer side calls (prepare_step, new_step). shard.py,
registry.py, rebind.py, the checkpoint functions and engine.py (the optimizer side) use it.

How the units and their slices are laid out is build.py's. Its hooks share one per-step
state (forward order, sync, the optimizers' parameters, the queued callback): one class.
Several optimizers on one model share it too: one backward reduces all of their gradients,
and the step closes (``new_step``) once each ended its own (owners.py).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ...comm import Comm
from ...comm.quantized_parts import WireFormat
from .. import gather_timeout as told
from ..grad_guard import GradGuard
from ..interop import active_ddp_module
from ..offload import OffloadPipeline
from .adopt import adopt
from .build import ModelLayout, local_pieces, shard_initial
from .context import UnitContext
from .order import ForwardOrder
from .reach import Reached, region_owners
from .recompute import Recompute, in_backward_now, keeps_gathered, slots
from .saved import SavedTensorHooks
from .secondary import Secondary
from .unit import GradPhase, Unit


def _from_ctx(name: str) -> property:
    return property(lambda self: getattr(self.ctx, name), doc=f"UnitContext.{name}.")


class Stage3Runtime:
    """The units of one model sharded by shard_model, and the hooks that move them."""

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
        self.gather_bits: int | None = None  # shard_model(gather_dtype=): the model's own
        p0 = next(p for _, _, ps in units for p in ps)
        self.dtype, self.device = p0.dtype, p0.device
        self.layout = ModelLayout(root, units, comm.world_size, prefetch)
        self.local_numel = self.layout.local_numel
        self.ctx = UnitContext(
            comm, self.dtype, self.device, local_numel=self.local_numel,
            gather_bytes=self.layout.gather_bytes(self.dtype, self.dtype),
            offload_params=offload_params, gather_timeout=gather_timeout)
        self.units: list[Unit] = self.layout.units(self.ctx)
        if comm.secondary is not None:  # shard_model(hpz=True): secondary.py
            self.ctx.secondary = Secondary(comm.secondary,
                                           [pl.padded_numel for pl in self.layout.plans],
                                           self.dtype, self.device)
        self.got_grad: dict[int, bool] = {}
        self.consumed: set[int] = set()  # whose optimizer ended its step (owners.py)
        self.grad_events = 0  # gradients delivered by autograd hooks
        # Run at the end of every synchronised backward, after the reduction (ZeroAdamW puts
        # its GradGuards on the parameters' .grad).
        self.backward_end_callbacks: list[Any] = []
        # Run when a backward reaches its first unit, before any unit reads p.grad (ZeroAdamW
        # takes the last step's stale GradGuards off).
        self.backward_begin_callbacks: list[Any] = []
        self._ddp_checked: set[int] = set()
        self._hooked: set[int] = set()
        # The parameters of the optimizers built on this model (None: no optimizer yet, every
        # gradient is reduced). The others are plain leaves, as in torch: their gradients stay
        # on .grad and accumulate until zeroed, or until add_param_group makes them the
        # optimizer's (its first step then reduces the sum, as DDP would have averaged it).
        self._managed: set[int] | None = None
        self.sync = True
        self.order = ForwardOrder({u.index for u in self.units if u.is_root})
        self._saved_hooks = SavedTensorHooks(self)
        self._callback_task = -1  # the backward whose end-of-backward callback is queued
        self._recompute = Recompute()  # activation checkpointing's forwards in the backward
        self._reached = Reached(self._region_ended)  # what this rank's forwards used
        self._param_unit: dict[int, tuple[Unit, int]] = {
            id(p): (u, j) for u in self.units for j, p in enumerate(u.params)}
        for u in self.units:
            u.slots = slots(u, self._param_unit)
        # The runtimes of one model (several dtypes: one each, shard_model; join).
        self.siblings: list[Stage3Runtime] = [self]

    def join(self, rts: list[Stage3Runtime]) -> None:
        """This runtime is one of ``rts``, one per dtype of one model: the first's
        saved-tensor hooks serve them all (saved.py)."""
        self.siblings = rts
        if self is rts[0]:
            self._saved_hooks.rts = rts
        else:
            self._saved_hooks.passive = True

    # What the context holds, under the names the optimizer side, the checkpoint functions
    # and the tests read (UnitContext documents them).
    local_params = _from_ctx("local_params")
    local_grads = _from_ctx("local_grads")
    param_arena = _from_ctx("param_arena")
    grad_arena = _from_ctx("grad_arena")
    gather_arena = _from_ctx("gather_arena")
    grads_on_host = _from_ctx("grads_on_host")
    grad_sink = _from_ctx("grad_sink")
    copier = _from_ctx("copier")
    overflow_bytes = _from_ctx("overflow_bytes")
    peak_units = _from_ctx("peak_units")
    broken = _from_ctx("broken")

    @property
    def param_names(self) -> dict[int, str]:
        """Parameter names by id, for error messages (set by shard_model)."""
        return self.ctx.param_names

    @param_names.setter
    def param_names(self, names: dict[int, str]) -> None:
        self.ctx.param_names = names

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in and kept in (``local_grads``)."""
        return self.ctx.grad_dtype

    def set_comm(self, dtype: torch.dtype, wire: WireFormat) -> None:
        """ZeroAdamW(reduce_dtype=, gather_dtype=): gradients are reduced and kept in ``dtype``
        and the units' collectives quantized as ``wire`` says. An optimizer built on this model
        already that communicates otherwise is refused: one model, one set of parts."""
        if dtype != self.ctx.grad_dtype and self._managed is not None:
            raise ValueError(
                f"reduce_dtype: another ZeroAdamW on this model reduces its gradients in "
                f"{self.ctx.grad_dtype}; every optimizer of one sharded model must reduce in "
                f"the same dtype (this one: {dtype})")
        if wire != self.ctx.wire and self._managed is not None:
            raise ValueError(
                f"gather_dtype / reduce_dtype: another ZeroAdamW on this model communicates "
                f"as {self.ctx.wire}; every optimizer of one sharded model must give the same "
                f"(this one: {wire})")
        if dtype != self.ctx.grad_dtype:
            self.ctx.set_grad_dtype(dtype, self.layout.gather_bytes(self.dtype, dtype))
        if wire != self.ctx.wire:
            self.ctx.set_wire(wire)

    def offload_grads(self, sink: OffloadPipeline) -> None:
        """ZeRO-Offload: gradients land in host memory through ``sink`` (UnitContext)."""
        self.ctx.offload_grads(sink)

    # -- setup -------------------------------------------------------------------------------
    def shard_parameters(self) -> None:
        """Copy (rank 0's) full parameters into this rank's slices and release them."""
        shard_initial(self.units, self.ctx)

    def install_hooks(self) -> None:
        """The forward hooks of every unit and the gradient hooks of its parameters."""
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out))
            # Runs even when the forward raised (checkpoint's early stop raises in the
            # recompute): the recompute's saved-tensor hooks come off in order.
            u.module.register_forward_hook(lambda m, a, out: self._after_forward(),
                                           always_call=True)
            if not u.is_root:  # the root stays gathered through the backward
                for sub in u.module.modules():
                    if sub is not u.module:
                        sub.register_forward_pre_hook(lambda m, a, u=u: self._inner_forward(u))
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

    # -- the unit's verbs, for shard.py and the optimizer side ---------------------------------
    def gather(self, u: Unit, *, wait: bool = True) -> None:
        """Unit.gather."""
        u.gather(wait=wait)

    def release(self, u: Unit) -> None:
        """Unit.release."""
        u.release()

    def finish_reduce(self) -> None:
        """Complete the reduce-scatter in flight, if any (Unit.finish_reduce)."""
        self.ctx.finish_reduce()

    # -- forward -----------------------------------------------------------------------------
    # The forward hooks are kept out of torch.compile's graphs (a graph break at each unit's
    # edges): traced, a graph took the gathers' parameter .data swaps as input mutations,
    # which AOTAutograd refuses, or inductor ran it with the zero-stride placeholders where it
    # had traced the gathered parameters (its stride assertion fails). Each unit's own forward
    # still compiles, with its parameters gathered.
    @torch._disable_dynamo
    def _pre_forward(self, u: Unit) -> None:
        if in_backward_now():  # activation checkpointing's recompute (recompute.py)
            self._reached.touched.add(u.index)
            task = torch._C._current_graph_task_id()
            if not self._recompute.nested(task, self._callback_task):
                self._queue_end_of_backward(task)
            self._recompute.enter(task)
            u.gather(own=True)
            return
        if u.is_root:
            self._check_not_in_ddp()
            self._recompute.reset()  # a backward that raised ended without its callback
            self.ctx.free_retired()
        if u.is_root and not u.in_backward:
            self._reached.begin_forward()
            self.order.start()
            if self.ctx.secondary is not None:  # hpZ: this forward gathers across nodes anew
                self.ctx.secondary.drop()
            if torch.is_grad_enabled():
                self._saved_hooks.enter()
        u.gather()
        if not u.in_backward:
            self._reached.ran(u.index)
            self.order.ran(u.index)
            for i in self.order.forward_prefetch(self.prefetch):
                nxt = self.units[i]
                if not nxt.gathered and not nxt.is_root:
                    nxt.gather(wait=False)

    def _check_not_in_ddp(self) -> None:
        ddp = active_ddp_module()
        if ddp is None or id(ddp) in self._ddp_checked:
            return
        if any(m is self.root for m in ddp.module.modules()):
            raise RuntimeError(
                "shard_model: the sharded model runs inside torch DistributedDataParallel. "
                "ZeroAdamW(stage=3) reduces its gradients itself; remove the DDP(...) wrapper")
        self._ddp_checked.add(id(ddp))

    @torch._disable_dynamo
    def _inner_forward(self, u: Unit) -> None:
        # A checkpoint region inside the unit's forward recomputes in the backward, possibly
        # after the unit's gradients were all in and it was released: it reads the
        # parameters now (recompute.py).
        if not in_backward_now():
            return
        if u.block is not None:  # gathered in the arena, and maybe viewed by this recompute
            u.gather()
            u.leave_arena(retire=True)
        else:
            u.gather(own=True)  # until its reduce, or the end of the backward

    @torch._disable_dynamo
    def _post_forward(self, u: Unit, out: Any) -> Any:
        grad_mode = torch.is_grad_enabled()
        if in_backward_now():
            # A recompute: the reentrant one's own backward begins the unit's at these
            # outputs; it stays gathered until its backward releases it (recompute.py).
            if grad_mode and not u.in_backward:
                self._hook_outputs(u, out)
            return out
        if grad_mode and not u.in_backward:
            self._hook_outputs(u, out)
        if u.is_root and not u.in_backward:
            self._saved_hooks.exit()
            if grad_mode:
                self._reached.add(out, self._units_of)
            for other in self.units:  # prefetched but never run this time
                if other.gathered and not other.in_backward and other is not u:
                    other.release()
        if u.in_backward:
            return out  # recompute under activation checkpointing: keep it for the backward
        if self.reshard or not grad_mode or u.is_root:
            u.release()
        return out

    def _hook_outputs(self, u: Unit, out: Any) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, u=u: self.pre_backward(u, g))

    @torch._disable_dynamo
    def _after_forward(self) -> None:
        if in_backward_now():
            self._recompute.leave()

    @torch._disable_dynamo
    def _after_root_forward(self, module: Any, args: Any, out: Any) -> None:
        if in_backward_now() or not (out is None and sys.exc_info()[0] is not None):
            return  # the forward returned: _post_forward has done everything
        self._saved_hooks.exit()
        for u in self.units:
            if u.gathered and not u.in_backward:
                u.release()
        self.order.abort()

    # -- backward ----------------------------------------------------------------------------
    def pre_backward(self, u: Unit, grad: torch.Tensor | None) -> torch.Tensor | None:
        """A gradient of ``u``'s output (or a saved tensor of it) is needed: its backward
        begins, it is gathered and the units before it are prefetched."""
        task = torch._C._current_graph_task_id()
        if not self._recompute.nested(task, self._callback_task):
            self._queue_end_of_backward(task)
        if not u.in_backward:
            u.begin_backward(self._reduces)
            u.waiting -= self._reached.unused(u.params, u.waiting, u.index)
            u.gather()
            for i in self.order.backward_prefetch(u.index, self.prefetch):
                nxt = self.units[i]
                if not nxt.gathered and not nxt.in_backward:
                    nxt.gather(wait=False)
        return grad

    def _queue_end_of_backward(self, task: int) -> None:
        # Per backward: one that raised never ran its own.
        if task != self._callback_task:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_task = task
            self.consumed.clear()  # new gradients, for every optimizer's parameters
            for cb in self.backward_begin_callbacks:
                cb()

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
        if u.grad_arrived(j):
            u.reduce(self._left_on, keep=keeps_gathered(u, self._reduces))

    def _region_ended(self, fn: Any) -> None:
        # A reentrant checkpoint region's backward is done (reach.py): the units whose whole
        # forward it held stop waiting for gradients that did not come, and reduce now if
        # none is due. HF checkpoints partial(forward, layer, ...) inside the layer's call;
        # a bound method of the unit (self._forward) is its whole forward too.
        whole, self._reached.touched = self._reached.touched, set()
        whole |= self._units_of(fn)
        for i in sorted(whole):
            u = self.units[i]
            if not u.in_backward or not u.waiting:
                continue
            u.waiting -= self._reached.unused(u.params, u.waiting, i, region_ended=True)
            if not u.waiting and self.sync:
                u.reduce(self._left_on, keep=keeps_gathered(u, self._reduces))

    def _units_of(self, fn: Any) -> set[int]:
        """The units a reentrant checkpoint region's function is the whole forward of."""
        owners = region_owners(fn)
        return {u.index for u in self.units if id(u.module) in owners}

    def _end_of_backward(self) -> None:
        """Units whose gradients did not all arrive (unused parameters) are reduced with zeros
        in a fixed order, the same on every rank; everything still gathered is released."""
        self._recompute.reset()
        self._reached.reset()
        pending = [u for u in self.units if u.in_backward]
        for u in sorted(pending, key=lambda x: -self.order.last_pos(x.index)):
            if self.sync:
                u.reduce(self._left_on)
            else:
                u.end_backward(reduced=False)
        self.finish_reduce()
        for u in self.units:
            u.release()
        self.ctx.free_retired()
        if self.sync:
            for cb in self.backward_end_callbacks:
                cb()

    def flush_no_sync(self) -> None:
        """After a no_sync accumulation finished with a synced backward, nothing is left;
        if the user steps right after no_sync backwards, reduce what the params hold."""
        for u in self.units:
            if any(self._left_on(p) for p in u.params):
                for p in u.params:  # set by hand, or left by no_sync: used as torch does
                    if self._left_on(p):
                        self.got_grad[id(p)] = True
                if not u.in_backward:  # else a backward that raised left it there
                    u.begin_backward(self._reduces)
                u.gather()
                u.reduce(self._left_on)
        self.finish_reduce()

    def _left_on(self, p: torch.nn.Parameter) -> bool:
        # What a unit's reduce takes: a GradGuard stands for a gradient in the slice already
        # (another optimizer's, owners.py, or a stale one, guard_set.py).
        return p.grad is not None and not isinstance(p.grad, GradGuard) and self._reduces(p)

    # -- p.data = t ----------------------------------------------------------------------------
    def adopt_assigned(self) -> None:
        """adopt.py for every released unit (at a step: no gather since the assignment)."""
        for u in self.units:
            if not u.gathered:
                adopt(u)

    def take_adopted(self) -> list[torch.nn.Parameter]:
        """The parameters adopted since the last call (their master takes the values)."""
        out, self.ctx.adopted = self.ctx.adopted, []
        return out

    # -- the optimizer side's seam -------------------------------------------------------------
    def shape_of(self, p: torch.nn.Parameter) -> torch.Size:
        """The full shape of a sharded parameter (of any dtype of the model: siblings)."""
        hit = next(r._param_unit[id(p)] for r in self.siblings if id(p) in r._param_unit)
        u, j = hit
        return u.shapes[j]

    def prepare_step(self) -> None:
        """Before the optimizer step: gradients left by no_sync backwards are reduced now,
        and slices of units that received nothing this step are zeroed (stale otherwise)."""
        self.flush_no_sync()
        if self.grad_sink is not None:
            self.grad_sink.drain()  # every landed gradient is in local_grads
        for u in self.units:
            if u.phase is not GradPhase.REDUCED:
                u.slice_of(self.local_grads).zero_()

    def new_step(self) -> None:
        """After the step (or zero_grad): nothing is reduced in the new step yet."""
        for u in self.units:
            u.new_step()
        self.got_grad = {}
        if self.ctx.secondary is not None:  # hpZ: the step changed the slices
            self.ctx.secondary.drop()

    def local_pieces(self) -> list[tuple[torch.nn.Parameter, int, int, torch.Tensor]]:
        """This rank's pieces of every parameter of the model, frozen ones included, every
        dtype's runtime's in turn (build.local_pieces)."""
        return [pc for r in self.siblings
                for pc in local_pieces(r.units, r.comm.rank, r.local_params)]

    def memory_stats(self) -> dict[str, int]:
        """Bytes of the slices and of the gather arena (UnitContext.memory_stats)."""
        return self.ctx.memory_stats()
