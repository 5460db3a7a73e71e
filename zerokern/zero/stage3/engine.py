"""Stage 3, P_os+g+p: parameters partitioned as well ((2 + 2 + K) Psi / N); the optimizer side.

The parameter side (gathering units just in time, reduce-scattering each unit's gradients as
its backward finishes) is the runtime of ``shard_model`` (unit.py, runtime.py); it owns this
rank's parameter and gradient slices. This engine composes the state of those slices (fp32
master for 16-bit parameters, the update rule's buffers; shard_state.py) and steps it unit by
unit; the new slice is all the next forward gathers, so nothing is gathered after the step.

An optimizer of part of the model's parameters (frozen ones, or another optimizer's beside it)
keeps a compact state: its layout's segments map its own runs of the slices to its local space
(layout.build_stage3_layout), and the step reads and writes the slices through them.

With offload the state is on the host (ZeRO-Offload): the runtime moves its gradient slice
there and lands each unit's reduced gradients through the state's staging slots; the CPU
kernel updates the host master and the new 16-bit slice goes back to the device slice (or is
written in place when ``shard_model(offload_params=True)`` keeps the parameter slice in host
memory, ZeRO-Infinity's ``offload_param``). Bitwise equal to stage 3 without offload: the
same reduced values, the same norm, the same elementwise kernel.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

import torch

from ...comm import Comm
from ..layout import Layout
from ..placement import BufferSpec
from ..rules import UpdateRule
from ..shard_state import ShardState
from ..stages.accounting import (
    stage3_memory,
    stage3_offload_memory,
    state_buffers,
    with_residuals,
)
from ..stages.base import Engine, Run
from ..state_format import StateFormat
from .owners import end_own_step

if TYPE_CHECKING:
    from .runtime import Stage3Runtime


def unit_ranges(layout: Layout, rt: Stage3Runtime) -> dict[int, list[tuple[int, int, int]]]:
    """Each unit's (local start, local stop, slice - local shift): the parts of the layout's
    segments inside the unit's slice (the whole slice range when the state is not compact)."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for u in rt.units:
        lo, hi = u.shard_start, u.shard_start + u.plan.shard_numel
        if not layout.compact:
            out[u.index] = [(lo, hi, 0)]
            continue
        out[u.index] = [(ls + a - ss, ls + b - ss, ss - ls) for ls, ss, n in layout.segments
                        if (a := max(lo, ss)) < (b := min(hi, ss + n))]
    return out


class Stage3(Engine):
    stage = 3

    def __init__(self, layout: Layout, params: list[torch.nn.Parameter], comm: Comm, *,
                 dtype: torch.dtype, device: torch.device, overlap: bool,
                 backend: str | None, runtime: Stage3Runtime, offload: bool = False,
                 fmt: StateFormat | None = None, seed: int = 0,
                 param_numels: list[int] | None = None,
                 grad_dtype: torch.dtype | None = None, rule: UpdateRule | None = None) -> None:
        super().__init__(layout, params, comm, dtype=dtype, device=device, overlap=overlap,
                         backend=backend, offload=offload, fmt=fmt, seed=seed,
                         param_numels=param_numels, grad_dtype=grad_dtype, rule=rule)
        self.rt = runtime
        # fp32 parameters kept in host memory are their own master; with offload every other
        # case updates a host fp32 copy and sends the result to the device slice.
        on_host = offload and runtime.offload_params
        master = self.wants_master(dtype, offload, on_host, self.fmt)
        self.slot = max(u.plan.shard_numel for u in runtime.units)
        self.unit_ranges = unit_ranges(layout, runtime)
        with torch.no_grad():
            self.state = self.make_state(master=master, own_grads=False,
                                         chunks=len(runtime.units), slot_numel=self.slot,
                                         params_on_host=on_host)
            sink = self.state.placement.grad_sink
            if sink is not None:  # the state is on the host: gradients land there
                self.rt.offload_grads(sink)
            self.init_master()

    @staticmethod
    def wants_master(dtype: torch.dtype, offload: bool, on_host: bool,
                     fmt: StateFormat) -> bool:
        """Whether the state keeps a copy of the values: the fp32 master of 16-bit
        parameters; with offload a host copy unless the parameters are in host memory
        already (master="none": that copy is bf16)."""
        if fmt.in_place:
            return offload and not on_host
        return dtype != torch.float32 or (offload and not on_host)

    @classmethod
    def device_specs(cls, layout: Layout, dtype: torch.dtype, offload: bool,
                     fmt: StateFormat | None = None, side_numel: int = 0,
                     grad_dtype: torch.dtype | None = None,
                     rule: UpdateRule | None = None) -> list[BufferSpec]:
        if offload:
            return []  # nothing of the optimizer on the device
        fmt = fmt or StateFormat()
        return ShardState.specs(layout.local_numel, dtype,
                                master=cls.wants_master(dtype, False, False, fmt),
                                own_grads=False, fmt=fmt, side_numel=side_numel, rule=rule)

    # -- gradients: reduced by the runtime during backward ---------------------------------------
    def on_grad(self, index: int) -> None:
        raise AssertionError("stage 3 gradients arrive through the shard_model runtime")

    def finish_grads(self) -> list[bool]:
        self.rt.prepare_step()
        return [self.rt.got_grad.get(id(p), False) for p in self.params]

    def grad_slices(self, start: int, numel: int) -> list[torch.Tensor]:
        return [self.rt.local_grads.narrow(0, self.layout.to_slice(start, numel), numel)]

    def end_step(self) -> None:
        end_own_step(self)  # the runtime's step: once every optimizer on it ended its own
        super().end_step()

    def has_grad(self, index: int) -> bool:
        return self.rt.got_grad.get(id(self.params[index]), False)

    def drop_grad(self, index: int) -> None:
        self.rt.finish_reduce()  # nothing lands in the slices while they are zeroed
        if self.rt.grad_sink is not None:
            self.rt.grad_sink.drain()
        self._zero_reduced(index)
        self.rt.got_grad[id(self.params[index])] = False

    def zero_grad(self, set_to_none: bool, keep: list[bool] | None = None) -> None:
        for p in self.params:
            p.grad = None
        end_own_step(self)

    def set_sync(self, value: bool) -> None:
        self.rt.sync = value

    # -- update: this rank's slices, unit by unit ----------------------------------------------
    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        rt, st = self.rt, self.state
        # Runs are disjoint ranges of the local space: sorted once, each range below finds
        # the runs it meets by bisection (units x segments x runs would be quadratic in the
        # parameter count on every step).
        runs = sorted(runs, key=lambda r: r.start)
        stops = [r.stop for r in runs]
        for u in rt.units:  # a unit's range fits a staging slot (offload)
            # The unit's local ranges (one per segment it holds, compact state), each stepped
            # on the same slice elements as if the state covered the whole slice.
            for lo, hi, shift in self.unit_ranges[u.index]:
                i = bisect.bisect_right(stops, lo)
                while i < len(runs) and runs[i].start < hi:
                    r = runs[i]
                    a, b = max(r.start, lo), min(r.stop, hi)
                    if a < b:
                        st.step(u.index, groups[r.group], a, b - a, r.step, grad_scale,
                                grad=rt.local_grads.narrow(0, a + shift, b - a),
                                param=rt.local_params.narrow(0, a + shift, b - a))
                    i += 1
        # The next forward's gathers read the device slices after the state's copies back.
        for u in rt.units:
            st.before_gather(u.index)

    # -- sharded state ----------------------------------------------------------------------
    def values(self, start: int, numel: int) -> torch.Tensor:
        if self.master is not None:
            return self.master.narrow(0, start, numel)
        return self.rt.local_params.narrow(0, self.layout.to_slice(start, numel), numel)

    def init_master(self) -> None:
        if self.master is None:
            return
        if not self.layout.compact:  # the state covers the whole slice
            self.master.copy_(self.rt.local_params)
            return
        for ls, ss, n in self.layout.segments:
            self.master.narrow(0, ls, n).copy_(self.rt.local_params.narrow(0, ss, n))

    def sync_params(self, gather: bool) -> None:
        for u in self.rt.units:  # a unit gathered now would keep its old values
            self.rt.release(u)
        if self.rt.ctx.secondary is not None:  # hpZ's in-node shares too (the slices change)
            self.rt.ctx.secondary.drop()
        if self.master is None:
            return
        for pc in self.layout.pieces:  # a compact state has no frozen pieces (0 elements)
            own = self.rt.local_params.narrow(
                0, self.layout.to_slice(pc.local_start, pc.numel), pc.numel)
            master = self.master.narrow(0, pc.local_start, pc.numel)
            if pc.param >= 0:
                own.copy_(master)
            else:  # a frozen parameter's unused master slot mirrors it, as init_master left it
                master.copy_(own)

    # -- accounting -------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        in_use = int(self.arena.stats()["in_use"])
        state = state_buffers(self.state)  # the state's kinds from its buffers as allocated
        h = self.state.placement.memory()  # its own arena: none on the device
        if not h:
            return with_residuals(stage3_memory(self.layout, self.rt, self.dtype, state,
                                                arena_in_use=in_use), self.rt.ctx.grad_comm)
        return stage3_offload_memory(self.layout, self.rt, self.dtype, state,
                                     arena_in_use=in_use, slot=self.slot,
                                     host_in_use=h["in_use"], host_capacity=h["capacity"])
