"""Stage 2, P_os+g: gradients sharded as well (2 Psi + (2 + K) Psi / N; with an fp32 reduce
dtype the pool and the shard are fp32: 2 Psi + (4 + K) Psi / N).

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
from .base import Run
from .flat import FlatEngine


class Stage2(FlatEngine):
    stage = 2
    pool_size = 2  # one bucket fills while the previous one is being reduced
    shards_grads = True

    @classmethod
    def stage_specs(cls, layout: Layout, dtype: torch.dtype,
                    grad_dtype: torch.dtype | None = None) -> list[BufferSpec]:
        return [BufferSpec("params", layout.flat_numel, dtype),
                *cls.pool_specs(layout, grad_dtype or dtype, cls.pool_size)]

    def alloc_grads(self) -> None:
        self.flat_grad = None
        self.alloc_pool(self.pool_size)

    @property
    def grad_shard(self) -> torch.Tensor | None:
        return self.state.grads

    # -- the bucket pool ------------------------------------------------------------------------
    def bucket_tensor(self, b: int) -> torch.Tensor:
        bk = self.layout.buckets[b]
        buf = self.buffers.get(b)
        if buf is None:
            buf = self.buffers[b] = self.take_buffer()
            plan = self.layout.plans[bk.group]
            if plan.padding > plan.tail_padding:
                buf.zero_()  # gaps before aligned parameters: the buffer is reused
            elif bk.local_index == plan.num_buckets - 1 and plan.padding:
                buf.narrow(0, bk.numel - plan.padding, plan.padding).zero_()
        # Pool buffers fit the largest group's bucket; groups may use smaller ones.
        return buf.narrow(0, 0, bk.numel)

    # -- gradients: reduce-scatter into the shard, free the bucket --------------------------------
    def after_delivery(self, index: int) -> None:
        self.params[index].grad = None  # the bucket holds it: full gradients never accumulate

    def keeps_earlier_rounds(self) -> bool:
        return False

    def start_reduce(self, b: int, src: torch.Tensor, accumulate: bool) -> Handle | None:
        return self.start_pooled_reduce(b, src, accumulate)

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        self.finish_pooled_reduce(b, src, self.buffers.pop(b))

    def zero_grad(self, set_to_none: bool, keep: list[bool] | None = None) -> None:
        for p in self.params:
            p.grad = None
        self.reducer.drain()  # a backward that raised may have left collectives in flight
        self.reducer.reset(zeroed=True)

    # -- update the shard, then all-gather every bucket ------------------------------------------
    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        st = self.state
        if st.on_host or st.master is None or self.cast:
            # New parameters into the flat buffer's slice (a gradient in another dtype than
            # the parameters' cannot take them in place).
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
