"""Stage 2, P_os+g: gradients sharded as well (2 Psi + (2 + K) Psi / N).

Buffers: the flat parameters, this rank's gradient shard, and a pool of two constant-size
bucket buffers. A gradient is copied into its bucket and freed at once (param.grad = None); a
full bucket is reduce-scattered into the shard (added to it when an earlier backward of the
same step was reduced already) and its buffer reused. With 16-bit parameters the update writes
the new 16-bit shard over the gradient it was computed from, element by element in the same
pass, and that shard is the all-gather's source: no extra Psi / N buffer.
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm import Handle
from ..layout import Bucket, Layout
from .base import BufferSpec, Run, average_
from .flat import FlatEngine


class Stage2(FlatEngine):
    stage = 2
    pool_size = 2  # one bucket fills while the previous one is being reduced

    @classmethod
    def buffer_specs(cls, layout: Layout, dtype: torch.dtype) -> list[BufferSpec]:
        cap = max((b.numel for b in layout.buckets), default=0)
        return [BufferSpec("params", layout.flat_numel, dtype),
                BufferSpec("grads", layout.local_numel, dtype),
                *cls.state_specs(layout, dtype),
                *[BufferSpec("buckets", cap, dtype)] * cls.pool_size]

    def alloc_grads(self) -> None:
        self.flat_grad = None
        self.grad_shard = self.alloc("grads", self.layout.local_numel, self.dtype)
        self.buffers: dict[int, torch.Tensor] = {}
        self.pool: list[torch.Tensor] = []
        self.allocated = 0

    def _shard(self, b: int) -> torch.Tensor:
        bk = self.layout.buckets[b]
        return self.grad_shard.narrow(0, bk.shard_start, bk.shard_numel)

    # -- the bucket pool ------------------------------------------------------------------------
    def bucket_tensor(self, b: int) -> torch.Tensor:
        bk = self.layout.buckets[b]
        buf = self.buffers.get(b)
        if buf is None:
            buf = self.buffers[b] = self._take_buffer()
            plan = self.layout.plans[bk.group]
            if bk.local_index == plan.num_buckets - 1 and plan.padding:
                buf.narrow(0, bk.numel - plan.padding, plan.padding).zero_()
        # Pool buffers fit the largest group's bucket; groups may use smaller ones.
        return buf.narrow(0, 0, bk.numel)

    def _take_buffer(self) -> torch.Tensor:
        # Fill the whole pool before waiting. Past that, wait for the oldest reduction to
        # free its buffer; allocate beyond the pool only when nothing is in flight (buckets
        # held back behind an earlier, incomplete one), which memory_stats() counts.
        if not self.pool:
            if self.allocated >= self.pool_size and self.reducer.inflight:
                self.reducer.wait_oldest()
            if not self.pool:
                self.allocated += 1
                return self._new_bucket()
        return self.pool.pop()

    def _new_bucket(self) -> torch.Tensor:
        numel = max(b.numel for b in self.layout.buckets)
        if len(self.pool_blocks) < self.pool_size:
            blk = self.arena.alloc(numel, self.dtype)
            self.pool_blocks.append(blk)
            return blk.tensor
        t = torch.empty(numel, dtype=self.dtype, device=self.device)
        self.overflow_bucket_bytes += t.numel() * t.element_size()
        return t

    def _release(self, b: int) -> None:
        self.pool.append(self.buffers.pop(b))

    # -- gradients: reduce-scatter into the shard, free the bucket --------------------------------
    def after_delivery(self, index: int) -> None:
        self.params[index].grad = None  # the bucket holds it: full gradients never accumulate

    def keeps_earlier_rounds(self) -> bool:
        return False

    def start_reduce(self, b: int, src: torch.Tensor, accumulate: bool) -> Handle | None:
        bk = self.layout.buckets[b]
        shard = self._shard(b)
        label = f"bucket {b} (group {bk.group}, {bk.numel} elements)"
        if not accumulate:
            h = self.comm.reduce_scatter(shard, src, label, async_op=self.overlap)
            if h is None:
                self.finish_reduce(b, src)
            return h
        out = torch.empty_like(shard)
        self.comm.reduce_scatter(out, src, label)
        shard.add_(average_(out, self.comm))
        self._release(b)
        return None

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        average_(self._shard(b), self.comm)
        self._release(b)

    def grad_slices(self, start: int, numel: int) -> list[torch.Tensor]:
        return [self.grad_shard.narrow(0, start, numel)]

    def zero_grad(self, set_to_none: bool) -> None:
        for p in self.params:
            p.grad = None
        self.reducer.drain()  # a backward that raised may have left collectives in flight
        self.reducer.reset(zeroed=True)

    # -- update the shard, then all-gather every bucket ------------------------------------------
    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        lowp = self.master is not None
        skipped = lowp and not all(active)

        def one(run: Run) -> None:
            s, n = run.start, run.stop - run.start
            if lowp:
                grad = self.grad_shard.narrow(0, s, n)
                self.fused(groups[run.group], self.master.narrow(0, s, n), grad, s, n,
                           run.step, grad_scale, grad)
                return
            for ls, fs, k in self.flat_slices(s, run.stop):
                self.fused(groups[run.group], self.flat_param.narrow(0, fs, k),
                           self.grad_shard.narrow(0, ls, k), ls, k, run.step, grad_scale, None)

        def source(bk: Bucket) -> torch.Tensor:
            lo, hi = bk.shard_start, bk.shard_start + bk.shard_numel
            if skipped:
                # Pieces the kernel skipped (no gradient on any rank) gather their current
                # value.
                for pc in self.layout.pieces:
                    a, b = max(pc.local_start, lo), min(pc.local_start + pc.numel, hi)
                    if a < b and not active[pc.param]:
                        self.grad_shard.narrow(0, a, b - a).copy_(self.master.narrow(0, a, b - a))
            return self.grad_shard.narrow(0, lo, bk.shard_numel)

        self.gather_buckets(runs, one, source if lowp else None)
