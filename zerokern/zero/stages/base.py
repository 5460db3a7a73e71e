"""What every stage engine has: the verbs ZeroAdamW calls, the optimizer-state buffers in one
arena, and the two operations every stage shares (averaging over the group, the fused update
of one local range).

A stage engine owns its buffers for one fixed layout: how they are allocated, how gradients
are reduced and averaged, how this rank's shard is updated and how parameters are gathered
again. ZeroAdamW keeps what is common to all stages (hooks, param groups, the norm-and-flags
all-reduce, clipping, the loss scaler, step counts, the public API).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ... import ops
from ...comm import Comm
from ...memory import Arena, Block
from ..layout import Layout

ARENA_ALIGN = 256  # bytes: every block starts on a 256-byte boundary (vector loads, DMA)


@dataclass(frozen=True)
class Run:
    """A range [start, stop) of this rank's local space updated by one fused launch."""

    group: int
    start: int
    stop: int
    step: int  # 1-based step count of every parameter in the range


@dataclass(frozen=True)
class BufferSpec:
    kind: str  # the memory_stats() key it is reported under
    numel: int
    dtype: torch.dtype


def average_(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum over the group -> mean, in the gradient dtype: the one division by N of every stage
    (as DDP divides its buckets), so all stages compute the same numbers."""
    if comm.world_size > 1:
        t.div_(comm.world_size)
    return t


def reserved_bytes(specs: list[BufferSpec]) -> int:
    """Arena bytes ``specs`` occupy: each block rounded up to the arena alignment."""
    return sum(-(-s.numel * _esize(s.dtype) // ARENA_ALIGN) * ARENA_ALIGN or ARENA_ALIGN
               for s in specs)


def _esize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class Engine(ABC):
    """One stage's buffers and sequence for a fixed layout."""

    stage: ClassVar[int]
    # Stage 0: every rank holds the full averaged gradient, so the norm is computed after the
    # flags all-reduce instead of summed by it.
    replicated_grads: ClassVar[bool] = False

    def __init__(self, layout: Layout, params: list[torch.nn.Parameter], comm: Comm, *,
                 dtype: torch.dtype, device: torch.device, overlap: bool,
                 backend: str | None) -> None:
        self.layout, self.params, self.comm = layout, params, comm
        self.dtype, self.device, self.backend = dtype, device, backend
        # Asynchronous collectives overlap backward on every backend: NCCL runs them on its
        # own stream, gloo on its worker threads (as DDP's reducer does).
        self.overlap = overlap and comm.world_size > 1
        self.has_master = dtype != torch.float32
        specs = self.buffer_specs(layout, dtype)
        self.arena = Arena(max(reserved_bytes(specs), ARENA_ALIGN), device,
                           alignment=ARENA_ALIGN)
        self.blocks: dict[str, Block] = {}
        self.master: torch.Tensor | None = None

    # -- buffers ----------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def buffer_specs(cls, layout: Layout, dtype: torch.dtype) -> list[BufferSpec]:
        """Every block the engine will take from its arena (pure: memory_stats() before the
        first step reports these without allocating anything)."""

    def alloc(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        blk = self.arena.alloc(numel, dtype)
        self.blocks[kind] = blk
        return blk.tensor.zero_()

    def alloc_state(self) -> None:
        n = self.layout.local_numel
        if self.has_master:
            self.master = self.alloc("master", n, torch.float32)
        self.exp_avg = self.alloc("exp_avg", n, torch.float32)
        self.exp_avg_sq = self.alloc("exp_avg_sq", n, torch.float32)

    @staticmethod
    def state_specs(layout: Layout, dtype: torch.dtype) -> list[BufferSpec]:
        n = layout.local_numel
        kinds = (["master"] if dtype != torch.float32 else []) + ["exp_avg", "exp_avg_sq"]
        return [BufferSpec(k, n, torch.float32) for k in kinds]

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
        """The fused AdamW over ``runs`` of this rank's shard, then the parameters gathered
        again where the stage keeps them replicated."""

    def fused(self, grp: dict[str, Any], param: torch.Tensor, grad: torch.Tensor, s: int,
              n: int, step: int, grad_scale: float, lp: torch.Tensor | None) -> None:
        """One launch on local range [s, s + n): ``param`` the fp32 values updated in place,
        ``lp`` the 16-bit copy written in the same pass."""
        ops.fused_adamw_(
            param, grad, self.exp_avg.narrow(0, s, n), self.exp_avg_sq.narrow(0, s, n),
            lr=float(grp["lr"]), beta1=float(grp["betas"][0]), beta2=float(grp["betas"][1]),
            eps=float(grp["eps"]), weight_decay=float(grp["weight_decay"]), step=step,
            grad_scale=grad_scale, param_lp=lp, backend=self.backend,
        )

    def update_in_place(self, runs: list[Run], groups: list[dict[str, Any]],
                        grad_scale: float, grads: torch.Tensor, params: torch.Tensor) -> None:
        """The update when local range [s, e) of ``grads`` and ``params`` (the 16-bit or fp32
        parameters) is the same range of the state (stage 0: everything; stage 3: the unit
        slices): fp32 parameters are updated in place, 16-bit ones through the master."""
        for r in runs:
            s, n = r.start, r.stop - r.start
            grad, own = grads.narrow(0, s, n), params.narrow(0, s, n)
            if self.master is not None:
                self.fused(groups[r.group], self.master.narrow(0, s, n), grad, s, n, r.step,
                           grad_scale, own)
            else:
                self.fused(groups[r.group], own, grad, s, n, r.step, grad_scale, None)

    @abstractmethod
    def end_step(self) -> None:
        """Forget this step's gradients (after step())."""

    @abstractmethod
    def zero_grad(self, set_to_none: bool) -> None: ...

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
