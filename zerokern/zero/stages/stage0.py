"""Stage 0, plain data parallelism (DDP's equivalent): every rank holds everything.

Buffers: the flat parameters, a persistent full-size flat gradient whose buckets are
all-reduced in place as they fill (DDP's gradient_as_bucket_view), and the optimizer state of
every parameter (local space == flat space). The update runs over everything on every rank,
so nothing is gathered afterwards.

Hybrid sharding (a 2-D mesh): each bucket's all-reduce is done hierarchically, reduce-scatter
within the shard group, the own slice all-reduced across the replicate group and averaged,
all-gathered back within the shard group (the traffic of stages 1-2 per mesh dim). With a
reduce dtype the bucket is copied into a flat gradient in that dtype and reduced there:
(2p + 4 + K) Psi bytes with fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import ops
from ...comm import Handle
from ..layout import Layout
from ..shard_state import BufferSpec
from .base import Run
from .flat import FlatEngine


class Stage0(FlatEngine):
    stage = 0
    replicated_grads = True

    @classmethod
    def stage_specs(cls, layout: Layout, dtype: torch.dtype,
                    grad_dtype: torch.dtype | None = None) -> list[BufferSpec]:
        specs = super().stage_specs(layout, dtype, grad_dtype)
        if grad_dtype not in (None, dtype):  # the averaged gradient in the reduce dtype
            specs.append(BufferSpec("grads", layout.flat_numel, grad_dtype))
        return specs

    def alloc_grads(self) -> None:
        super().alloc_grads()
        # The averaged gradient the step reads: autograd's flat gradient itself, or its copy
        # in the reduce dtype, which every round overwrites (the 16-bit buckets keep this
        # rank's own sum, so each round's all-reduce gives the step's total).
        self.avg_grad = (self.alloc("reduced grads", self.layout.flat_numel, self.grad_dtype)
                         if self.cast else self.flat_grad)

    def max_inflight(self) -> int | None:
        # Hybrid: the in-place reduce-scatter of gloo's point-to-point path holds a receive
        # buffer per bucket in flight (as stage 1).
        return 2 if self.hybrid and self.overlap and self.comm.in_place_scratch() else None

    def _reduced(self, b: int) -> torch.Tensor:
        bk = self.layout.buckets[b]
        return self.avg_grad.narrow(0, bk.flat_start, bk.numel)

    # -- gradients: all-reduce each bucket in place --------------------------------------------
    def start_reduce(self, b: int, src: torch.Tensor, accumulate: bool) -> Handle | None:
        t = self._reduced(b)
        self.grad_comm.load(t, [src], [0])  # the reduce dtype's copy (else t is src)
        # Flat: an all-reduce. Hybrid: reduce-scatter within the shard group (in place), the
        # own slice summed across replicas and averaged, all-gathered back (comm/parts.py).
        h = self.grad_comm.reduce_full(t, self.own(b, t), self.bucket_label(b),
                                       async_op=self.overlap)
        if h is None:
            self.finish_reduce(b, src)
        return h

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        t = self._reduced(b)
        self.grad_comm.finish_full(t, self.own(b, t), self.bucket_label(b))

    def keep_set_grads(self, values: dict[int, torch.Tensor]) -> None:
        # As views of autograd's flat gradient: without zero_grad() the next backward adds
        # to them (the flat gradient in the parameters' dtype holds this rank's own sum).
        with torch.no_grad():
            for i, t in values.items():
                self.after_delivery(i)
                self.params[i].grad.copy_(t)

    def grad_sq_norm(self) -> torch.Tensor:
        return ops.sq_norm(self.avg_grad, backend=self.backend)

    def grad_slices(self, start: int, numel: int) -> list[torch.Tensor]:
        return [self.avg_grad.narrow(0, start, numel)]  # local space = flat space

    # -- update: everything, on every rank ----------------------------------------------------
    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        for r in runs:
            s, n = r.start, r.stop - r.start
            self.state.step(0, groups[r.group], s, n, r.step, grad_scale,
                            grad=self.avg_grad.narrow(0, s, n),
                            param=self.flat_param.narrow(0, s, n))

    # -- sharded state (local == flat) ---------------------------------------------------------
    def values(self, start: int, numel: int) -> torch.Tensor:
        src = self.master if self.master is not None else self.flat_param
        return src.narrow(0, start, numel)

    def init_master(self) -> None:
        if self.master is not None:
            self.master.copy_(self.flat_param)

    def sync_params(self, gather: bool) -> None:
        if self.master is not None:
            self.flat_param.copy_(self.master)
