"""Stage 1, P_os: the optimizer state (fp32 master for 16-bit params, both moments) sharded.

Buffers: the flat parameters and a full-size flat gradient (4 Psi + K Psi / N). Each bucket
is reduce-scattered in place: this rank's slice of it becomes the sum over ranks and the other
slices are zeroed, so a further backward (accumulation without no_sync) adds to that sum and
the next reduce-scatter gives the total; the average is taken once, at the step. The update
writes the new parameters straight into this rank's slice of each bucket, the source of the
in-place all-gather that follows.

With offload the state keeps a host copy of the gradient shard: after each bucket's
reduce-scatter this rank's slice (the sum over ranks so far) overwrites its range of it, and
the division by N is done there.

Hybrid sharding (a 2-D mesh): the own slices hold the shard group's sum of every round of the
step; they are all-reduced across the replicate group once, at the step, then averaged by
S * R (and landed on the host state).

With a reduce dtype (fp32 gradients for 16-bit parameters) autograd still accumulates into the
16-bit flat gradient, but each bucket is copied into an fp32 buffer of a two-buffer pool and
reduce-scattered into an fp32 gradient shard kept by the state, as stage 2 does (and the
16-bit bucket is zeroed for a further backward): 4 Psi + (4 + K) Psi / N.
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm import Handle
from ..layout import Layout
from ..shard_state import BufferSpec
from .base import Run
from .flat import FlatEngine


class Stage1(FlatEngine):
    stage = 1
    pool_size = 2  # with a reduce dtype: the fp32 copies of buckets being reduced

    @classmethod
    def cast_shards_grads(cls) -> bool:
        return True  # the sum in the reduce dtype cannot live in autograd's flat gradient

    @classmethod
    def stage_specs(cls, layout: Layout, dtype: torch.dtype,
                    grad_dtype: torch.dtype | None = None) -> list[BufferSpec]:
        specs = super().stage_specs(layout, dtype, grad_dtype)
        if grad_dtype not in (None, dtype):
            specs += cls.pool_specs(layout, grad_dtype, cls.pool_size)
        return specs

    def alloc_grads(self) -> None:
        super().alloc_grads()
        if self.cast:
            self.alloc_pool(self.pool_size)

    def max_inflight(self) -> int | None:
        # Each in-place exchange of gloo's point-to-point reduce-scatter holds a receive
        # buffer until it completes: keep at most two in flight, a constant budget like
        # stage 2's pool.
        return 2 if self.overlap and self.comm.in_place_scratch() and not self.cast else None

    # -- gradients: reduce-scatter in place, keep the own slice's sum ---------------------------
    def start_reduce(self, b: int, src: torch.Tensor, accumulate: bool) -> Handle | None:
        if self.cast:
            # The bucket's copy in the reduce dtype is reduced into the state's shard (as
            # stage 2 does); autograd's bucket starts again from zero for a further backward.
            buf = self.take_buffer()
            self.grad_comm.load(buf, [src], [0])
            src.zero_()
            return self.start_pooled_reduce(b, src, accumulate, buf)
        h = self.grad_comm.reduce(self.own(b, src), src, self.bucket_label(b),
                                  async_op=self.overlap)
        if h is None:
            self.finish_reduce(b, src)
        return h

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        if self.cast:
            self.finish_pooled_reduce(b, src)
            return
        n, r = self.comm.world_size, self.comm.rank
        bk = self.layout.buckets[b]
        v = src.view(n, bk.shard_numel)
        if r > 0:
            v[:r].zero_()
        if r < n - 1:
            v[r + 1:].zero_()
        if not self.hybrid:  # hybrid: landed once summed across replicas (finish_grads)
            # A host state takes a copy of the sum so far (overwritten: it is the running
            # total).
            self.state.receive(b, bk.shard_start, self.own(b, src), accumulate=False)

    def finish_grads(self) -> list[bool]:
        got = super().finish_grads()
        if self.cast:
            return got  # every round was summed across replicas and averaged as it landed
        if self.hybrid:
            self._sum_across_replicas()
        if self.state.grads is not None:  # the host copy
            self.grad_comm.average(self.state.grads)
        else:
            for _, fs, k in self.flat_slices(0, self.layout.local_numel):
                self.grad_comm.average(self.flat_grad.narrow(0, fs, k))  # sums until now
        return got

    def _sum_across_replicas(self) -> None:
        """Hybrid sharding: every bucket's own slice holds the sum over this shard group of
        every round of the step; summed across the replicate group once, at the step (a
        per-round sum would count the earlier rounds R times), then landed on the host
        state when there is one."""
        self.grad_comm.sum_across(
            [(self.own(bk.index, self.flat_grad.narrow(0, bk.flat_start, bk.numel)),
              self.bucket_label(bk.index)) for bk in self.layout.buckets],
            async_op=self.overlap)
        if self.state.grads is not None:
            for bk in self.layout.buckets:
                own = self.own(bk.index, self.flat_grad.narrow(0, bk.flat_start, bk.numel))
                self.state.receive(bk.index, bk.shard_start, own, accumulate=False)
            self.state.drain()

    # -- update this rank's slices in place, then all-gather every bucket ----------------------
    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        self.gather_buckets(runs, lambda run, bk: self.step_into_params(run, bk, groups,
                                                                        grad_scale),
                            self.params_source)
