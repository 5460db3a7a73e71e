"""Stage 2, P_os+g: gradients sharded as well (2 Psi + (2 + K) Psi / N).

Buffers: the flat parameters and a pool of two constant-size bucket buffers; the gradient
shard is the state's. A gradient is copied into its bucket and freed at once (param.grad =
None); a full bucket is reduce-scattered into the shard (added to it when an earlier backward
of the same step was reduced already) and its buffer reused. With 16-bit parameters and the
state on the device, the update writes the new 16-bit shard over the gradient it was computed
from, element by element in the same pass, and that shard is the all-gather's source: no
extra Psi / N buffer.

With offload, only the bucket pool is on the device: each bucket is reduce-scattered in place
into this rank's slice of it, averaged there and landed in the host shard; the new parameters
come back into this rank's slice of the flat parameters, the gather's source.
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm import Handle
from ..layout import Bucket, Layout
from ..shard_state import BufferSpec
from .base import Run, average_
from .flat import FlatEngine


class Stage2(FlatEngine):
    stage = 2
    pool_size = 2  # one bucket fills while the previous one is being reduced
    shards_grads = True

    @classmethod
    def stage_specs(cls, layout: Layout, dtype: torch.dtype) -> list[BufferSpec]:
        cap = max((b.numel for b in layout.buckets), default=0)
        return [BufferSpec("params", layout.flat_numel, dtype),
                *[BufferSpec("buckets", cap, dtype)] * cls.pool_size]

    def alloc_grads(self) -> None:
        self.flat_grad = None
        self.buffers: dict[int, torch.Tensor] = {}
        # The pool's blocks are taken now, as planned: the arena reserves them anyway, and
        # memory_stats() then says the same before and after the first step whether one
        # slot or both get used (one, when every reduction completes at once: world size 1,
        # overlap_comm=False).
        numel = max((b.numel for b in self.layout.buckets), default=0)
        self.pool_blocks = [self.arena.alloc(numel, self.dtype) for _ in range(self.pool_size)]
        self.pool: list[torch.Tensor] = [blk.tensor for blk in reversed(self.pool_blocks)]
        self.allocated = self.pool_size

    @property
    def grad_shard(self) -> torch.Tensor | None:
        return self.state.grads

    # -- the bucket pool ------------------------------------------------------------------------
    def bucket_tensor(self, b: int) -> torch.Tensor:
        bk = self.layout.buckets[b]
        buf = self.buffers.get(b)
        if buf is None:
            buf = self.buffers[b] = self._take_buffer()
            plan = self.layout.plans[bk.group]
            if plan.padding > plan.tail_padding:
                buf.zero_()  # gaps before aligned parameters: the buffer is reused
            elif bk.local_index == plan.num_buckets - 1 and plan.padding:
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
        out, may_async = self.state.reduce_target(bk.shard_start, self.own(b, src), accumulate)
        self._reducing[b] = (out, accumulate)
        h = self.comm.reduce_scatter(out, src, f"bucket {b} (group {bk.group}, "
                                     f"{bk.numel} elements)",
                                     async_op=self.overlap and may_async)
        if h is None:
            self.finish_reduce(b, src)
        return h

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        out, accumulate = self._reducing.pop(b)
        average_(out, self.comm)
        self.state.receive(b, self.layout.buckets[b].shard_start, out, accumulate)
        self._release(b)

    def zero_grad(self, set_to_none: bool) -> None:
        for p in self.params:
            p.grad = None
        self.reducer.drain()  # a backward that raised may have left collectives in flight
        self.reducer.reset(zeroed=True)

    # -- update the shard, then all-gather every bucket ------------------------------------------
    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        st = self.state
        if st.on_host or st.master is None:  # new parameters into the flat buffer's slice
            self.gather_buckets(runs, lambda run, bk: self.step_into_params(
                run, bk, groups, grad_scale), self.params_source)
            return
        skipped = not all(active)

        def one(run: Run, bk: Bucket) -> None:
            # 16-bit on the device: the new values over the gradient they come from
            s, n = run.start, run.stop - run.start
            grad = st.grad_range(s, n)
            st.step(bk.index, groups[run.group], s, n, run.step, grad_scale, grad=grad,
                    param=None, lp=grad)

        def source(bk: Bucket) -> torch.Tensor:
            lo, hi = bk.shard_start, bk.shard_start + bk.shard_numel
            if skipped:
                # Pieces the kernel skipped (no gradient on any rank) gather their current
                # value.
                for pc in self.layout.pieces:
                    a, b = max(pc.local_start, lo), min(pc.local_start + pc.numel, hi)
                    if a < b and not active[pc.param]:
                        st.grad_range(a, b - a).copy_(st.master.narrow(0, a, b - a))
            return st.grad_range(lo, bk.shard_numel)

        self.gather_buckets(runs, one, source)
