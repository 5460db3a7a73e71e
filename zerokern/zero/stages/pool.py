"""The bucket pool of stage 2 (and of stage 1 with a reduce dtype): constant-size bucket
buffers that gradients are copied into and reduce-scattered from, given back as soon as
nothing reads them any more; the reduced slice is completed by the reduce part (comm/parts.py:
across a mesh's replicas, asynchronously) and landed in the state.

A mixin of FlatEngine (flat.py), which owns the arena, the layout, the state and the reducer
this works with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...comm import Handle
from ..layout import Layout
from ..placement import BufferSpec

if TYPE_CHECKING:
    from ...comm.parts import FlatReduce
    from ...memory import Arena
    from ..grads import GradReducer
    from ..shard_state import ShardState


class BucketPool:
    """Stage 2's pool of bucket buffers (FlatEngine's; flat.py)."""

    # FlatEngine's, used here
    arena: Arena
    layout: Layout
    grad_dtype: torch.dtype
    device: torch.device
    overlap: bool
    reducer: GradReducer
    state: ShardState
    grad_comm: FlatReduce
    overflow_bucket_bytes: int
    _reducing: dict[int, tuple[torch.Tensor, bool, torch.Tensor | None]]
    own: Any
    bucket_label: Any
    finish_reduce: Any

    @staticmethod
    def pool_specs(layout: Layout, dtype: torch.dtype, size: int) -> list[BufferSpec]:
        """``size`` bucket buffers of the largest bucket, in ``dtype`` (the pool)."""
        cap = max((b.numel for b in layout.buckets), default=0)
        return [BufferSpec("buckets", cap, dtype)] * size

    # -- the bucket pool (stage 2; stage 1 with a reduce dtype) --------------------------------
    def alloc_pool(self, size: int) -> None:
        """Take the pool's blocks now, as planned: the arena reserves them anyway, and
        memory_stats() then says the same before and after the first step whether one slot or
        all get used (one, when every reduction completes at once: world size 1,
        overlap_comm=False)."""
        self.buffers: dict[int, torch.Tensor] = {}
        numel = max((b.numel for b in self.layout.buckets), default=0)
        self.pool_blocks = [self.arena.alloc(numel, self.grad_dtype) for _ in range(size)]
        self.pool: list[torch.Tensor] = [blk.tensor for blk in reversed(self.pool_blocks)]
        self.allocated = size
        self.pool_cap = size

    def take_buffer(self) -> torch.Tensor:
        """A pool buffer. Fill the whole pool before waiting; past that, wait for the oldest
        reduction to free its buffer; allocate beyond the pool only when nothing is in
        flight (buckets held back behind an earlier, incomplete one), which memory_stats()
        counts."""
        if not self.pool:
            if self.allocated >= self.pool_cap and self.reducer.inflight:
                self.reducer.wait_oldest()
            if not self.pool:  # a buffer held by its cross-replica sum (the result is in it)
                self.grad_comm.settle()
            if not self.pool:
                self.allocated += 1
                return self._new_bucket()
        return self.pool.pop()

    def _new_bucket(self) -> torch.Tensor:
        numel = max(b.numel for b in self.layout.buckets)
        t = torch.empty(numel, dtype=self.grad_dtype, device=self.device)
        self.overflow_bucket_bytes += t.numel() * t.element_size()
        return t

    def release_buffer(self, buf: torch.Tensor) -> None:
        self.pool.append(buf)

    def start_pooled_reduce(self, b: int, src: torch.Tensor, accumulate: bool,
                            buf: torch.Tensor | None = None) -> Handle | None:
        """Reduce-scatter bucket ``b`` (``src``, a pool buffer, or ``buf`` holding its copy)
        into the state's gradient shard: added to it when an earlier backward of this step
        was reduced already. finish_pooled_reduce averages and gives the buffer back."""
        bk = self.layout.buckets[b]
        send = src if buf is None else buf.narrow(0, 0, bk.numel)
        out, may_async = self.state.reduce_target(bk.shard_start, self.own(b, send), accumulate)
        self._reducing[b] = (out, accumulate, buf)
        h = self.grad_comm.reduce(out, send, self.bucket_label(b),
                                  async_op=self.overlap and may_async)
        if h is None:
            self.finish_reduce(b, src)  # the stage's: it gives its buffer back
        return h

    def finish_pooled_reduce(self, b: int, src: torch.Tensor,
                             carrier: torch.Tensor | None = None) -> None:
        """After bucket ``b``'s reduce-scatter: its slice completed (summed across replicas,
        averaged) and landed in the state; ``carrier`` (or the copy start_pooled_reduce
        took) goes back to the pool as soon as nothing still reads it: at once when the
        slice lives elsewhere, else once it landed."""
        out, accumulate, buf = self._reducing.pop(b)
        carrier = buf if carrier is None else carrier
        held = carrier is not None and _overlaps(out, carrier)
        shard_start = self.layout.buckets[b].shard_start

        def land() -> None:
            self.state.receive(b, shard_start, out, accumulate)
            if held:
                self.release_buffer(carrier)

        self.grad_comm.complete(out, self.bucket_label(b), land)
        if carrier is not None and not held:
            self.release_buffer(carrier)


def _overlaps(t: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``t`` lies in ``buf``'s memory."""
    lo = buf.data_ptr()
    return lo <= t.data_ptr() < lo + buf.numel() * buf.element_size()
