"""Stage 1, P_os: the optimizer state (fp32 master for 16-bit params, both moments) sharded.

Buffers: the flat parameters and a full-size flat gradient (4 Psi + K Psi / N). Each bucket
is reduce-scattered in place: this rank's slice of it becomes the sum over ranks and the other
slices are zeroed, so a further backward (accumulation without no_sync) adds to that sum and
the next reduce-scatter gives the total; the average is taken once, at the step. The update
writes the new parameters straight into this rank's slice of each bucket, the source of the
in-place all-gather that follows.
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm import Handle
from .base import Run, average_
from .flat import FlatEngine


class Stage1(FlatEngine):
    stage = 1

    def max_inflight(self) -> int | None:
        # Each in-place exchange of gloo's point-to-point reduce-scatter holds a receive
        # buffer until it completes: keep at most two in flight, a constant budget like
        # stage 2's pool.
        return 2 if self.overlap and self.comm.in_place_scratch() else None

    def _own_slices(self) -> list[torch.Tensor]:
        return [self.flat_grad.narrow(0, fs, k)
                for _, fs, k in self.flat_slices(0, self.layout.local_numel)]

    # -- gradients: reduce-scatter in place, keep the own slice's sum ---------------------------
    def start_reduce(self, b: int, src: torch.Tensor, accumulate: bool) -> Handle | None:
        bk = self.layout.buckets[b]
        mine = src.narrow(0, self.comm.rank * bk.shard_numel, bk.shard_numel)
        h = self.comm.reduce_scatter(mine, src, f"bucket {b} (group {bk.group}, "
                                     f"{bk.numel} elements)", async_op=self.overlap)
        if h is None:
            self.finish_reduce(b, src)
        return h

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        n, r = self.comm.world_size, self.comm.rank
        v = src.view(n, self.layout.buckets[b].shard_numel)
        if r > 0:
            v[:r].zero_()
        if r < n - 1:
            v[r + 1:].zero_()

    def finish_grads(self) -> list[bool]:
        got = super().finish_grads()
        for t in self._own_slices():  # sums over ranks until now
            average_(t, self.comm)
        return got

    def grad_slices(self, start: int, numel: int) -> list[torch.Tensor]:
        return [self.flat_grad.narrow(0, fs, k)
                for _, fs, k in self.flat_slices(start, start + numel)]

    # -- update this rank's slices in place, then all-gather every bucket ----------------------
    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        def one(run: Run) -> None:
            for ls, fs, k in self.flat_slices(run.start, run.stop):
                grad = self.flat_grad.narrow(0, fs, k)
                fp = self.flat_param.narrow(0, fs, k)
                if self.master is not None:
                    self.fused(groups[run.group], self.master.narrow(0, ls, k), grad, ls, k,
                               run.step, grad_scale, fp)
                else:
                    self.fused(groups[run.group], fp, grad, ls, k, run.step, grad_scale, None)

        self.gather_buckets(runs, one)
