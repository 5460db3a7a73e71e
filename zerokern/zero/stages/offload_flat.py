"""Stages 1 and 2 with ZeRO-Offload (``ZeroAdamW(..., offload="cpu")``).

The device keeps the flat 16-bit (or fp32) parameters and, per stage, the gradient buffers
the reduction needs: stage 1 its full-size flat gradient, stage 2 only the two constant-size
bucket buffers. This rank's fp32 master, both moments and its gradient shard live in a host
arena (offload.py).

Backward: each bucket is reduce-scattered in place into this rank's slice of the bucket and,
as soon as that completes, the slice is copied through a staging slot into the host gradient
shard (overwritten, or added to for a further backward of the same step), while the rest of
backward goes on. Step: bucket by bucket, the CPU kernel updates the host master and writes
the new 16-bit shard into a staging slot in the same pass; the slot is copied into this
rank's slice of the flat parameters and the bucket's in-place all-gather starts, while the
CPU updates the next bucket.

Bitwise equal to the same run without offload: the gradient reaching the kernel is the same
reduce-scatter result averaged by the same division in the same dtype (a sum of the same
terms; the in-place reduce-scatter only swaps the operands of its first addition, which is
commutative), the norm is the same per-parameter pass over the same values, and the kernel
is the same elementwise kernel on the same values (on a CPU device, the very same backend).
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from ...comm import Comm, Handle
from ..layout import Bucket, Layout
from ..offload import HostArena, OffloadPipeline
from .base import BufferSpec, Run, average_, reserved_bytes
from .flat import FlatEngine
from .stage1 import Stage1
from .stage2 import Stage2


def _esize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _slot_numel(layout: Layout) -> int:
    return max((b.shard_numel for b in layout.buckets), default=1)


class OffloadFlat(FlatEngine):
    """What stages 1-2 share with offload: the host state, the landing of each bucket's
    gradient slice, the per-bucket CPU update and return of the new parameters."""

    offload = True

    def __init__(self, layout: Layout, params: list[torch.nn.Parameter], comm: Comm, *,
                 dtype: torch.dtype, device: torch.device, overlap: bool,
                 backend: str | None) -> None:
        specs = type(self).host_specs(layout, dtype)
        self.host = HostArena([(s.kind, s.numel, s.dtype) for s in specs], device)
        self.pipe = OffloadPipeline(self.host, device, len(layout.buckets), _slot_numel(layout),
                                    dtype, backend)
        self._accumulate: dict[int, bool] = {}
        self._shard_starts = [b.shard_start for b in layout.buckets]
        super().__init__(layout, params, comm, dtype=dtype, device=device, overlap=overlap,
                         backend=backend)

    @classmethod
    def host_specs(cls, layout: Layout, dtype: torch.dtype) -> list[BufferSpec]:
        n = layout.local_numel
        slot = _slot_numel(layout)
        return [BufferSpec("master", n, torch.float32), BufferSpec("exp_avg", n, torch.float32),
                BufferSpec("exp_avg_sq", n, torch.float32), BufferSpec("grads", n, dtype),
                BufferSpec("staging", slot, dtype), BufferSpec("staging", slot, dtype)]

    def alloc_state(self) -> None:
        # An fp32 master for fp32 parameters too: the kernel runs on the host copy, the
        # device parameters receive the result.
        n = self.layout.local_numel
        self.master = self.host.alloc("master", n, torch.float32)
        self.exp_avg = self.host.alloc("exp_avg", n, torch.float32)
        self.exp_avg_sq = self.host.alloc("exp_avg_sq", n, torch.float32)
        self.host_grads = self.host.alloc("grads", n, self.dtype)

    def _own(self, b: int, src: torch.Tensor) -> torch.Tensor:
        bk = self.layout.buckets[b]
        return src.narrow(0, self.comm.rank * bk.shard_numel, bk.shard_numel)

    def _host_shard(self, b: int) -> torch.Tensor:
        bk = self.layout.buckets[b]
        return self.host_grads.narrow(0, bk.shard_start, bk.shard_numel)

    def _land(self, b: int, slice_: torch.Tensor, accumulate: bool) -> None:
        # fence: device work issued later (the next round's writes into this bucket memory)
        # waits for the copy out of it.
        self.pipe.land(b, slice_, self._host_shard(b), accumulate).fence()

    # -- the step -----------------------------------------------------------------------------
    def finish_grads(self) -> list[bool]:
        got = FlatEngine.finish_grads(self)
        self.pipe.drain()
        return got

    def grad_slices(self, start: int, numel: int) -> list[torch.Tensor]:
        return [self.host_grads.narrow(0, start, numel)]  # the host shard, in local space

    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        def one(run: Run) -> None:
            b = bisect.bisect_right(self._shard_starts, run.start) - 1
            for ls, fs, k in self.flat_slices(run.start, run.stop):
                self.pipe.update(b, groups[run.group], self.master.narrow(0, ls, k),
                                 self.host_grads.narrow(0, ls, k),
                                 self.exp_avg.narrow(0, ls, k), self.exp_avg_sq.narrow(0, ls, k),
                                 run.step, grad_scale, self.flat_param.narrow(0, fs, k))

        def source(bk: Bucket) -> torch.Tensor:
            # Only the updated ranges are copied back: parameters without a gradient on any
            # rank keep their device values, which are their master rounded already.
            self.pipe.fence_returns()
            self.pipe.returned(bk.index)
            return self.flat_param.narrow(0, bk.flat_start + self.comm.rank * bk.shard_numel,
                                          bk.shard_numel)

        self.gather_buckets(runs, one, source)

    def end_step(self) -> None:
        super().end_step()
        self.pipe.end_step()

    # -- accounting -------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        a = self.arena.stats()
        pool = sum(b.nbytes for b in self.pool_blocks) + self.overflow_bucket_bytes
        h = self.host.stats()
        return offload_flat_memory(self.layout, self.dtype, type(self).buffer_specs(
            self.layout, self.dtype), buckets=pool, overflow=self.overflow_bucket_bytes,
            scratch=self.comm.scratch_peak, in_use=int(a["in_use"]),
            capacity=int(a["capacity"]), host_in_use=h["in_use"], host_capacity=h["capacity"])

    @classmethod
    def planned_memory(cls, layout: Layout, dtype: torch.dtype) -> dict[str, int]:
        """memory_stats() before the first step, from the buffers the engine will take."""
        specs = cls.buffer_specs(layout, dtype)
        nbytes = reserved_bytes(specs)
        host = reserved_bytes(cls.host_specs(layout, dtype))
        pool = sum(s.numel * _esize(s.dtype) for s in specs if s.kind == "buckets")
        return offload_flat_memory(layout, dtype, specs, buckets=pool, overflow=0, scratch=0,
                                   in_use=nbytes, capacity=nbytes, host_in_use=host,
                                   host_capacity=host)


def offload_flat_memory(layout: Layout, dtype: torch.dtype, specs: list[BufferSpec], *,
                        buckets: int, overflow: int, scratch: int, in_use: int, capacity: int,
                        host_in_use: int, host_capacity: int) -> dict[str, int]:
    """Stages 1-2 with offload, by kind and by side. Device: the flat parameters (2Ψ), stage
    1's full-size gradient (2Ψ), stage 2's bucket pool. Host: master and moments (12Ψ/N),
    the gradient shard (2Ψ/N for 16-bit) and two staging slots."""
    esz = _esize(dtype)
    psi = sum(p.total_numel for p in layout.plans)
    local_real = sum(pc.numel for pc in layout.pieces if pc.param >= 0)
    full_grad = any(s.kind == "grads" for s in specs)
    slot = _slot_numel(layout)
    pad_local = layout.local_numel - local_real
    out = {"params": psi * esz, "grads": psi * esz if full_grad else 0,
           "master": 0, "exp_avg": 0, "exp_avg_sq": 0, "buckets": buckets,
           "padding": (layout.flat_numel - psi) * esz * (2 if full_grad else 1),
           "comm_scratch": scratch, "arena_in_use": in_use, "arena_capacity": capacity,
           "total": in_use + overflow + scratch}
    out.update(host_memory(local_real, pad_local, esz, 2 * slot * esz, host_in_use,
                           host_capacity))
    out["device_total"] = out["total"]
    return out


def host_memory(local_real: int, pad_local: int, esz: int, staging: int, in_use: int,
                capacity: int, params: int = 0) -> dict[str, int]:
    """The host side of memory_stats() with offload (``params``: stage 3's offloaded
    parameter shard, in bytes)."""
    return {"host_master": 4 * local_real, "host_exp_avg": 4 * local_real,
            "host_exp_avg_sq": 4 * local_real, "host_grads": esz * local_real,
            "host_params": params, "host_staging": staging,
            "host_padding": pad_local * (12 + esz),
            "host_arena_in_use": in_use, "host_arena_capacity": capacity, "host_total": in_use}


class Stage1Offload(OffloadFlat, Stage1):
    """Stage 1: the full-size flat gradient stays on the device (the stage's P_os keeps it);
    after each bucket's in-place reduce-scatter this rank's slice (the sum over ranks so
    far) overwrites its range of the host gradient shard; the division by N is done there."""

    @classmethod
    def buffer_specs(cls, layout: Layout, dtype: torch.dtype) -> list[BufferSpec]:
        return [BufferSpec("params", layout.flat_numel, dtype),
                BufferSpec("grads", layout.flat_numel, dtype)]

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        Stage1.finish_reduce(self, b, src)
        self._land(b, self._own(b, src), accumulate=False)

    def finish_grads(self) -> list[bool]:
        got = OffloadFlat.finish_grads(self)
        average_(self.host_grads, self.comm)  # the own slices' sums, as stage 1 divides them
        return got


class Stage2Offload(OffloadFlat, Stage2):
    """Stage 2: only the bucket pool on the device; each bucket is reduce-scattered in place
    into this rank's slice of it, averaged there, landed on the host, and its buffer reused."""

    @classmethod
    def buffer_specs(cls, layout: Layout, dtype: torch.dtype) -> list[BufferSpec]:
        cap = max((b.numel for b in layout.buckets), default=0)
        return [BufferSpec("params", layout.flat_numel, dtype),
                *[BufferSpec("buckets", cap, dtype)] * cls.pool_size]

    def alloc_grads(self) -> None:
        self.flat_grad = None
        self.grad_shard = None  # on the host: host_grads
        self.buffers: dict[int, torch.Tensor] = {}
        self.pool: list[torch.Tensor] = []
        self.allocated = 0

    def start_reduce(self, b: int, src: torch.Tensor, accumulate: bool) -> Handle | None:
        bk = self.layout.buckets[b]
        self._accumulate[b] = accumulate
        h = self.comm.reduce_scatter(self._own(b, src), src,
                                     f"bucket {b} (group {bk.group}, {bk.numel} elements)",
                                     async_op=self.overlap)
        if h is None:
            self.finish_reduce(b, src)
        return h

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        mine = average_(self._own(b, src), self.comm)
        self._land(b, mine, self._accumulate.pop(b, False))
        self._release(b)
