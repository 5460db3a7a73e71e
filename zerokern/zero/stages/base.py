"""What every stage engine has: the verbs ZeroAdamW calls, the device arena, and the state
part it composes (shard_state.py: master, moments, their placement and the fused step).

A stage engine owns what differs between stages for one fixed layout: which buffers the
parameters and gradients live in, how gradients are reduced and averaged, and how parameters
come back after the step. Where the optimizer state lives (``offload``) is a placement given
to its ShardState, not a class per stage. ZeroAdamW keeps what is common to all stages (hooks,
param groups, the norm-and-flags all-reduce, clipping, the loss scaler, step counts, the
public API).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...comm import Comm
from ...memory import Arena, Block
from ..layout import Layout
from ..placement import BufferSpec, OnDevice, OnHost, Placement
from ..rules import ADAMW, UpdateRule
from ..shard_state import ShardState
from ..state_format import RunPlan, StateFormat, plan_runs

ARENA_ALIGN = 256  # bytes: every block starts on a 256-byte boundary (vector loads, DMA)


@dataclass(frozen=True)
class Run:
    """A range [start, stop) of this rank's local space updated by one fused launch."""

    group: int
    start: int
    stop: int
    step: int  # 1-based step count of every parameter in the range


def reserved_bytes(specs: list[BufferSpec]) -> int:
    """Arena bytes ``specs`` occupy: each block rounded up to the arena alignment."""
    return sum(-(-s.numel * _esize(s.dtype) // ARENA_ALIGN) * ARENA_ALIGN or ARENA_ALIGN
               for s in specs)


def _esize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class Engine(ABC):
    """One stage's buffers and sequence for a fixed layout, composed with this rank's
    ShardState (on the device, or on the host when ``offload``)."""

    stage: ClassVar[int]
    # Stage 0: every rank holds the full averaged gradient, so the norm is computed after the
    # flags all-reduce instead of summed by it.
    replicated_grads: ClassVar[bool] = False

    def __init__(self, layout: Layout, params: list[torch.nn.Parameter], comm: Comm, *,
                 dtype: torch.dtype, device: torch.device, overlap: bool,
                 backend: str | None, offload: bool = False, fmt: StateFormat | None = None,
                 seed: int = 0, param_numels: list[int] | None = None,
                 grad_dtype: torch.dtype | None = None, rule: UpdateRule | None = None) -> None:
        self.layout, self.params, self.comm = layout, params, comm
        self.rule = rule or ADAMW  # the update the state is stepped with (rules/)
        self.dtype, self.device, self.backend = dtype, device, backend
        # The dtype gradients are reduced in and reach the step in (ZeroAdamW(reduce_dtype=):
        # fp32 for 16-bit parameters, FSDP2's MixedPrecisionPolicy(reduce_dtype=)).
        self.grad_dtype = grad_dtype or dtype
        self.offload = offload
        # How the state is stored (state_format.py); compressed formats step in runs.
        self.fmt, self.seed = fmt or StateFormat(), seed
        numels = param_numels if param_numels is not None else [p.numel() for p in params]
        self.run_plan: RunPlan | None = (None if self.fmt.is_default
                                         else plan_runs(layout.pieces, numels, self.fmt))
        # Asynchronous collectives overlap backward on every backend: NCCL runs them on its
        # own stream, gloo on its worker threads (as DDP's reducer does).
        self.overlap = overlap and comm.world_size > 1
        specs = self.device_specs(layout, dtype, offload, self.fmt, self.side_numel,
                                  self.grad_dtype, self.rule)
        self.arena = Arena(max(reserved_bytes(specs), ARENA_ALIGN), device,
                           alignment=ARENA_ALIGN)
        self.blocks: dict[str, Block] = {}
        self.state: ShardState  # set by the stage once its own buffers exist (make_state)

    # -- buffers ----------------------------------------------------------------------------
    @property
    def side_numel(self) -> int:
        return 0 if self.run_plan is None else self.run_plan.side_numel

    @classmethod
    @abstractmethod
    def device_specs(cls, layout: Layout, dtype: torch.dtype, offload: bool,
                     fmt: StateFormat | None = None, side_numel: int = 0,
                     grad_dtype: torch.dtype | None = None,
                     rule: UpdateRule | None = None) -> list[BufferSpec]:
        """Every block the engine will take from its device arena, its state's included
        when on the device (pure: memory_stats() before the first step reports these
        without allocating anything); ``grad_dtype``: the reduce dtype (default ``dtype``);
        ``rule``: the update rule whose buffers the state holds (default AdamW)."""

    def alloc(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        blk = self.arena.alloc(numel, dtype)
        self.blocks[kind] = blk
        return blk.tensor.zero_()

    def make_state(self, *, master: bool, own_grads: bool, chunks: int, slot_numel: int,
                   params_on_host: bool = False) -> ShardState:
        """This rank's state over the local space, placed where ``offload`` says: the device
        arena, or a host arena whose pipeline moves ``chunks`` buckets or units through
        staging slots of ``slot_numel`` elements."""
        n = self.layout.local_numel
        placement: Placement
        if self.offload:
            specs = ShardState.specs(n, self.grad_dtype, master=master, own_grads=own_grads,
                                     fmt=self.fmt, side_numel=self.side_numel, rule=self.rule)
            specs += [BufferSpec("staging", slot_numel, self.dtype)] * 2
            placement = OnHost(specs, self.device, chunks=chunks, slot_numel=slot_numel,
                               dtype=self.dtype, backend=self.backend,
                               params_on_host=params_on_host)
        else:
            placement = OnDevice(self.alloc, self.backend)
        return ShardState(n, self.grad_dtype, placement, master=master, own_grads=own_grads,
                          fmt=self.fmt, runs=self.run_plan, seed=self.seed, rule=self.rule)

    @property
    def master(self) -> torch.Tensor | None:
        return self.state.master

    # The host placement's parts, for tests and diagnostics (the stages use its verbs only).
    @property
    def pipe(self) -> Any:
        """The host pipeline (offload only)."""
        return self.state.placement.pipe  # type: ignore[attr-defined]

    @property
    def host(self) -> Any:
        """The host arena (offload only)."""
        return self.state.placement.host  # type: ignore[attr-defined]

    # -- the step -----------------------------------------------------------------------------
    @abstractmethod
    def finish_grads(self) -> list[bool]:
        """Complete the reduction of this step's gradients (averaged over the group) and say
        which parameters got a gradient on this rank."""

    def grad_sq_norm(self) -> torch.Tensor:
        """Squared norm of the full averaged gradient, for a stage that holds it on every rank
        (``replicated_grads``: stage 0). The sharded stages sum their per-parameter squares
        from grad_slices() instead, in the pass that feeds torch's utilities."""
        raise NotImplementedError

    @abstractmethod
    def grad_slices(self, start: int, numel: int) -> list[torch.Tensor]:
        """The averaged gradient of local range [start, start + numel), after
        finish_grads(), as the tensors that hold it (per-parameter norms for torch's
        clipping utilities, grad_guard.py)."""

    @abstractmethod
    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        """The update rule's step over ``runs`` of this rank's shard, then the parameters
        gathered again where the stage keeps them replicated."""

    def end_step(self) -> None:
        """Forget this step's gradients (after step()); the state's copies are complete."""
        self.state.end_step()

    def drop_grad(self, index: int) -> None:
        """Forget what parameter ``index`` accumulated and reduced in this step so far (its
        ``p.grad`` was set by hand or to None after backward: grad_edits.py): zeroed in every
        buffer that holds it, and no gradient of it counted on this rank. A further backward
        of the step adds to the zeros, as autograd adds to ``p.grad``."""
        raise NotImplementedError

    def has_grad(self, index: int) -> bool:
        """Whether parameter ``index`` got a gradient on this rank in this step so far."""
        raise NotImplementedError

    def keep_set_grads(self, values: dict[int, torch.Tensor]) -> None:
        """After the step: gradients the script set by hand (``values``, by index) go back on
        ``p.grad`` where the stage keeps gradients after the step (stage 0), as torch keeps
        them there; the other stages keep none (stale guards stand there: guard_set.py)."""
        del values

    def _zero_reduced(self, index: int) -> None:
        """Zero parameter ``index``'s part of the averaged gradient the step reads."""
        for pc in self.layout.pieces:
            if pc.param == index:
                for t in self.grad_slices(pc.local_start, pc.numel):
                    t.zero_()

    @abstractmethod
    def zero_grad(self, set_to_none: bool, keep: list[bool] | None = None) -> None:
        """Drop this step's gradients. Without ``set_to_none`` the parameters ``keep`` names
        (default all) hold a zero gradient: stages 0-1 a view of the flat gradient, zeroed."""

    @abstractmethod
    def set_sync(self, value: bool) -> None:
        """no_sync on (False) or off: gradients accumulate locally without communication."""

    # -- sharded state ----------------------------------------------------------------------
    @abstractmethod
    def values(self, start: int, numel: int) -> torch.Tensor:
        """Writable fp32 view of local range [start, start + numel): the master for 16-bit
        parameters, the parameters' own elements for fp32 (local ranges never straddle a
        bucket)."""

    @abstractmethod
    def sync_params(self, gather: bool) -> None:
        """After the values were written: the parameters take them (16-bit: rounded to
        nearest even). ``gather`` (stages 1-2): all-gather so every rank holds the new full
        parameters (a collective); without it the caller writes them itself."""

    @abstractmethod
    def init_master(self) -> None:
        """master <- the current parameters (a fresh optimizer state)."""

    @abstractmethod
    def memory_stats(self) -> dict[str, int]: ...
