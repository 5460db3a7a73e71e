"""This rank's optimizer state, as one part every stage composes: the fp32 master (or none),
both moments, the gradient shard when the state keeps its own, where they live, and the fused
AdamW step over any range of them.

A stage decides *which* elements are this rank's and how their gradients are reduced and
their parameters come back (stages/); this file decides how the state of those elements is
stored and updated. Where it is stored is a placement given to the state, not a subclass per
stage:

- ``OnDevice``: blocks of the engine's device arena; the step is the device kernel writing the
  16-bit parameters in the same pass.
- ``OnHost`` (ZeRO-Offload): one host arena (pinned on CUDA) with two staging slots; reduced
  gradients land through the slots during backward, the step runs the CPU kernel and sends
  the new parameters back through them (offload.py moves the bytes).

A new state format (what the moments are stored as, whether there is a master) changes
``ShardState`` and the kernels; a new placement is a new class beside these two. Neither
touches the stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import ops
from .offload import HostArena, OffloadPipeline, Ticket


@dataclass(frozen=True)
class BufferSpec:
    """One block a stage or its state will take from an arena (pure: memory_stats() before
    the first step reports these without allocating)."""

    kind: str  # the memory_stats() key it is reported under
    numel: int
    dtype: torch.dtype


def _adamw(values: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
           grp: dict[str, Any], step: int, grad_scale: float, lp: torch.Tensor | None,
           backend: str | None) -> None:
    ops.fused_adamw_(
        values, grad, m, v, lr=float(grp["lr"]), beta1=float(grp["betas"][0]),
        beta2=float(grp["betas"][1]), eps=float(grp["eps"]),
        weight_decay=float(grp["weight_decay"]), step=step, grad_scale=grad_scale,
        param_lp=lp, backend=backend)


class OnDevice:
    """The state in the engine's device arena, updated in place by the device kernel."""

    on_host = False

    def __init__(self, alloc: Callable[[str, int, torch.dtype], torch.Tensor],
                 backend: str | None) -> None:
        self.alloc, self.backend = alloc, backend

    def update(self, chunk: int, grp: dict[str, Any], values: torch.Tensor, grad: torch.Tensor,
               m: torch.Tensor, v: torch.Tensor, step: int, grad_scale: float,
               new: torch.Tensor | None) -> None:
        _adamw(values, grad, m, v, grp, step, grad_scale, new, self.backend)

    def reduce_target(self, target: torch.Tensor, own: torch.Tensor,
                      accumulate: bool) -> tuple[torch.Tensor, bool]:
        # Straight into the shard; a further backward of the same step reduces into a
        # temporary (synchronously: it is added at once) and adds it.
        return (target, True) if not accumulate else (torch.empty_like(target), False)

    def receive(self, chunk: int, reduced: torch.Tensor, target: torch.Tensor,
                accumulate: bool) -> None:
        if reduced.data_ptr() == target.data_ptr():
            return  # reduced in place
        if accumulate:
            target.add_(reduced)
        else:
            target.copy_(reduced)

    def drain(self) -> None:
        pass

    def before_gather(self, chunk: int) -> None:
        pass

    def end_step(self) -> None:
        pass


class OnHost:
    """The state in a host arena (ZeRO-Offload): the CPU kernel updates it, reduced gradients
    and new parameters cross through two staging slots, one chunk (bucket or unit) at a time.
    ``params_on_host``: the parameters' own slices live in host memory too (stage 3's
    ``offload_params``): the kernel writes them directly, nothing goes back."""

    on_host = True

    def __init__(self, specs: list[BufferSpec], device: torch.device, *, chunks: int,
                 slot_numel: int, dtype: torch.dtype, backend: str | None,
                 params_on_host: bool = False) -> None:
        self.host = HostArena([(s.kind, s.numel, s.dtype) for s in specs], device)
        self.pipe = OffloadPipeline(self.host, device, chunks, slot_numel, dtype, backend)
        self.params_on_host = params_on_host

    def alloc(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.host.alloc(kind, numel, dtype)

    def update(self, chunk: int, grp: dict[str, Any], values: torch.Tensor, grad: torch.Tensor,
               m: torch.Tensor, v: torch.Tensor, step: int, grad_scale: float,
               new: torch.Tensor | None) -> None:
        if new is None:  # fp32 parameters in host memory: updated in place
            self.pipe.update(chunk, grp, values, grad, m, v, step, grad_scale, None)
        elif self.params_on_host:
            self.pipe.update(chunk, grp, values, grad, m, v, step, grad_scale, None,
                             lp_host=new)
        else:
            self.pipe.update(chunk, grp, values, grad, m, v, step, grad_scale, new)

    def reduce_target(self, target: torch.Tensor, own: torch.Tensor,
                      accumulate: bool) -> tuple[torch.Tensor, bool]:
        # In place, into this rank's slice of the send buffer; landed on the host after.
        return own, True

    def receive(self, chunk: int, reduced: torch.Tensor, target: torch.Tensor,
                accumulate: bool) -> None:
        # fence: device work issued later (the next round's writes into the send buffer)
        # waits for the copy out of it.
        self.land(chunk, reduced, target, accumulate).fence()

    def land(self, chunk: int, reduced: torch.Tensor, target: torch.Tensor,
             accumulate: bool) -> Ticket:
        return self.pipe.land(chunk, reduced, target, accumulate)

    def drain(self) -> None:
        self.pipe.drain()

    def before_gather(self, chunk: int) -> None:
        """Device work issued from now on (the chunk's all-gather, the next forward) reads
        the parameters after every copy back issued so far."""
        self.pipe.fence_returns()
        self.pipe.returned(chunk)

    def end_step(self) -> None:
        self.pipe.end_step()


Placement = OnDevice | OnHost


class ShardState:
    """The optimizer state of ``numel`` local elements: ``master`` (fp32, or None when the
    parameters are updated in place), ``exp_avg``, ``exp_avg_sq`` and, when ``own_grads``,
    ``grads`` (the reduced gradient shard, in the parameters' dtype), allocated from the
    placement in that order."""

    def __init__(self, numel: int, grad_dtype: torch.dtype, placement: Placement, *,
                 master: bool, own_grads: bool) -> None:
        self.numel, self.placement = numel, placement
        alloc = placement.alloc
        self.master = alloc("master", numel, torch.float32) if master else None
        self.exp_avg = alloc("exp_avg", numel, torch.float32)
        self.exp_avg_sq = alloc("exp_avg_sq", numel, torch.float32)
        self.grads = alloc("grads", numel, grad_dtype) if own_grads else None

    @staticmethod
    def specs(numel: int, grad_dtype: torch.dtype, *, master: bool,
              own_grads: bool) -> list[BufferSpec]:
        """The blocks a state of these options takes (pure)."""
        out = [BufferSpec("master", numel, torch.float32)] if master else []
        out += [BufferSpec("exp_avg", numel, torch.float32),
                BufferSpec("exp_avg_sq", numel, torch.float32)]
        if own_grads:
            out.append(BufferSpec("grads", numel, grad_dtype))
        return out

    @property
    def on_host(self) -> bool:
        return self.placement.on_host

    # -- the step ------------------------------------------------------------------------------
    def step(self, chunk: int, grp: dict[str, Any], start: int, numel: int, step: int,
             grad_scale: float, *, grad: torch.Tensor, param: torch.Tensor | None,
             lp: torch.Tensor | None = None) -> None:
        """The fused AdamW of local range [start, start + numel) with ``grad``: the master is
        updated and the new parameters written to ``lp`` if given, else to ``param`` (the
        parameters' own elements; 16-bit ones in the kernel's pass); without a master
        ``param`` itself is updated in place. ``chunk``: the bucket or unit (the host
        pipeline's bookkeeping)."""
        m = self.exp_avg.narrow(0, start, numel)
        v = self.exp_avg_sq.narrow(0, start, numel)
        if self.master is None:
            assert param is not None
            self.placement.update(chunk, grp, param, grad, m, v, step, grad_scale, None)
        else:
            self.placement.update(chunk, grp, self.master.narrow(0, start, numel), grad, m,
                                  v, step, grad_scale, lp if lp is not None else param)

    # -- gradients ----------------------------------------------------------------------------
    def grad_range(self, start: int, numel: int) -> torch.Tensor:
        assert self.grads is not None
        return self.grads.narrow(0, start, numel)

    def reduce_target(self, start: int, own: torch.Tensor,
                      accumulate: bool) -> tuple[torch.Tensor, bool]:
        """Where a reduce-scatter of local range [start, start + own.numel()) writes, and
        whether it may run asynchronously; ``own``: this rank's slice of the send buffer."""
        return self.placement.reduce_target(self.grad_range(start, own.numel()), own,
                                            accumulate)

    def receive(self, chunk: int, start: int, reduced: torch.Tensor, accumulate: bool) -> None:
        """The reduced gradient of local range [start, start + reduced.numel()) into the
        shard: overwritten, or added to (a further backward of the same step). A no-op
        when the state keeps no gradient of its own (the stage's buffer is the gradient)."""
        if self.grads is not None:
            self.placement.receive(chunk, reduced, self.grad_range(start, reduced.numel()),
                                   accumulate)

    def drain(self) -> None:
        """Every gradient received so far is in the shard."""
        self.placement.drain()

    def before_gather(self, chunk: int) -> None:
        """The chunk's new parameters are in place (device order) for its gather."""
        self.placement.before_gather(chunk)

    def end_step(self) -> None:
        self.placement.end_step()
