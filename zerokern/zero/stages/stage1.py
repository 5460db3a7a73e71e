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

    # -- gradients: reduce-scatter in place, keep the own slice's sum ---------------------------
    def start_reduce(self, b: int, src: torch.Tensor, accumulate: bool) -> Handle | None:
        bk = self.layout.buckets[b]
        h = self.comm.reduce_scatter(self.own(b, src), src, f"bucket {b} (group {bk.group}, "
                                     f"{bk.numel} elements)", async_op=self.overlap)
        if h is None:
            self.finish_reduce(b, src)
        return h

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        n, r = self.comm.world_size, self.comm.rank
        bk = self.layout.buckets[b]
        v = src.view(n, bk.shard_numel)
        if r > 0:
            v[:r].zero_()
        if r < n - 1:
            v[r + 1:].zero_()
        # A host state takes a copy of the sum so far (overwritten: it is the running total).
        self.state.receive(b, bk.shard_start, self.own(b, src), accumulate=False)

    def finish_grads(self) -> list[bool]:
        got = super().finish_grads()
        if self.state.grads is not None:  # the host copy
            average_(self.state.grads, self.comm)
        else:
            for _, fs, k in self.flat_slices(0, self.layout.local_numel):
                average_(self.flat_grad.narrow(0, fs, k), self.comm)  # sums until now
        return got

    # -- update this rank's slices in place, then all-gather every bucket ----------------------
    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        self.gather_buckets(runs, lambda run, bk: self.step_into_params(run, bk, groups,
                                                                        grad_scale),
                            self.params_source)
