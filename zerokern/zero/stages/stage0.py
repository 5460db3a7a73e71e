"""Stage 0, plain data parallelism (DDP's equivalent): every rank holds everything.

Buffers: the flat parameters, a persistent full-size flat gradient whose buckets are
all-reduced in place as they fill (DDP's gradient_as_bucket_view), and the optimizer state of
every parameter (local space == flat space). The update runs over everything on every rank,
so nothing is gathered afterwards.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import ops
from ...comm import Handle
from .base import Run, average_
from .flat import FlatEngine


class Stage0(FlatEngine):
    stage = 0
    replicated_grads = True

    # -- gradients: all-reduce each bucket in place --------------------------------------------
    def start_reduce(self, b: int, src: torch.Tensor, accumulate: bool) -> Handle | None:
        bk = self.layout.buckets[b]
        h = self.comm.all_reduce(src, f"bucket {b} (group {bk.group}, {bk.numel} elements)",
                                 async_op=self.overlap)
        if h is None:
            average_(src, self.comm)
        return h

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        average_(src, self.comm)

    def grad_sq_norm(self) -> torch.Tensor:
        return ops.sq_norm(self.flat_grad, backend=self.backend)

    def grad_slices(self, start: int, numel: int) -> list[torch.Tensor]:
        return [self.flat_grad.narrow(0, start, numel)]  # local space = flat space

    # -- update: everything, on every rank ----------------------------------------------------
    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        for r in runs:
            s, n = r.start, r.stop - r.start
            self.state.step(0, groups[r.group], s, n, r.step, grad_scale,
                            grad=self.flat_grad.narrow(0, s, n),
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
