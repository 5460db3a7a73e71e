"""Gradient path of stages 0-2: copy each gradient into its bucket as autograd produces it,
and reduce buckets strictly in index order so that every rank issues the same collectives in
the same order (a bucket that completes early waits for the ones before it; at step() the
remaining buckets are flushed with zeros for gradients this rank never produced).

stage 0: buckets are slices of a persistent full-size flat gradient, all-reduced in place.
stage 1: same flat gradient (full-size); each bucket reduce-scattered in place: this rank's
         slice of it becomes the sum over ranks (the step divides by N) and the other slices
         are zeroed, so a further backward (accumulation without no_sync) adds to that sum
         and the next reduce-scatter gives the total. No separate gradient shard.
stage 2: buckets are a small pool of constant-size buffers; a gradient is copied in and
         freed at once (param.grad = None), a full bucket is reduce-scattered and *added* to
         the gradient shard, then the buffer is reused. Memory: the shard plus the pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import ops
from ..comm import Comm
from .layout import Bucket, Layout


class GradReducer:
    def __init__(
        self,
        layout: Layout,
        params: list[torch.nn.Parameter],
        comm: Comm,
        *,
        flat_grad: torch.Tensor | None,
        grad_shard: torch.Tensor | None,
        alloc_bucket: Callable[[], torch.Tensor],
        pool_size: int = 2,
        overlap: bool,
        backend: str | None,
    ) -> None:
        self.layout, self.params, self.comm = layout, params, comm
        self.stage = layout.stage
        self.flat_grad, self.grad_shard = flat_grad, grad_shard
        self.alloc_bucket, self.backend = alloc_bucket, backend
        self.pool_size, self.allocated = pool_size, 0
        # Asynchronous collectives overlap backward on every backend: NCCL runs them on its
        # own stream, gloo on its worker threads (as DDP's reducer does).
        self.overlap = overlap and comm.world_size > 1
        # Fragments of every parameter: (bucket, offset in bucket, param offset, numel).
        self.frags: list[list[tuple[int, int, int, int]]] = [[] for _ in params]
        self.bucket_frag_count = [0] * len(layout.buckets)
        bstart = 0
        for g, plan in enumerate(layout.plans):
            order = layout.orders[g]
            for f in plan.fragments:
                b = bstart + f.bucket_index
                self.frags[order[f.param_index]].append((b, f.bucket_offset, f.param_offset,
                                                         f.numel))
                self.bucket_frag_count[b] += 1
            bstart += plan.num_buckets
        self.sync = True
        self._callback_queued = False
        self.pool: list[torch.Tensor] = []
        self.reset()

    # -- per-step state ----------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything about the current step (after step() or zero_grad())."""
        nb = len(self.layout.buckets)
        self.buffers: dict[int, torch.Tensor] = {}
        self.reduced_once = [False] * nb  # stage 2: later reductions add to the shard
        self.got_grad = [False] * len(self.params)
        self.inflight: list[tuple[object, torch.Tensor, Bucket]] = []
        self._new_round()

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._drain()

    def _new_round(self) -> None:
        """A backward pass starts filling buckets from scratch (several per step when
        gradients are accumulated without no_sync)."""
        self.pending = list(self.bucket_frag_count)
        self.filled: list[set[int]] = [set() for _ in self.layout.buckets]
        self.next_bucket = 0

    # -- hooks ------------------------------------------------------------------------------
    def on_grad_ready(self, index: int, in_backward: bool = True) -> None:
        if not self.sync:
            return  # no_sync: autograd keeps accumulating into param.grad
        if in_backward and not self._callback_queued:
            # Like DDP's finalize: when this backward ends, wait for its asynchronous
            # collectives, so gradients are final and no bucket is written while in flight.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        frags = self.frags[index]
        if self.next_bucket >= len(self.layout.buckets) or (
            frags and index in self.filled[frags[0][0]]
        ):
            # This parameter was already delivered in this round: a new backward pass began.
            # Finish the old round first (same collective order on every rank), and wait for
            # its collectives: the new round writes into the same buckets.
            self._flush_round()
            self._drain()
            self._new_round()
        p = self.params[index]
        grad = p.grad
        if grad is None:
            return
        self.got_grad[index] = True
        flat_g = grad.detach().reshape(-1)
        if not flat_g.is_contiguous():
            flat_g = flat_g.contiguous()
        for b, boff, poff, n in frags:
            dst = self._bucket_tensor(b)
            same = dst.data_ptr() + boff * dst.element_size() == (
                flat_g.data_ptr() + poff * flat_g.element_size()
            )
            if not same:  # stage 0/1 after the first round: autograd wrote in place already
                ops.flatten_into_([flat_g], dst, [boff], ranges=[(poff, n)], backend=self.backend)
            self.filled[b].add(index)
            self.pending[b] -= 1
            # Reduce (and free) each bucket as soon as it is complete, before taking the
            # next one: a parameter larger than a bucket then streams through the pool.
            self._reduce_ready()
        if self.stage == 2:
            p.grad = None  # the bucket holds it now: full-size gradients never accumulate
        elif self.flat_grad is not None:
            # stage 0/1: from now on autograd accumulates straight into the flat buffer
            off = self.layout.param_flat_offset[index]
            p.grad = self.flat_grad.narrow(0, off, p.numel()).view_as(p)
        self._reduce_ready()

    # -- buckets ----------------------------------------------------------------------------
    def _bucket_tensor(self, b: int) -> torch.Tensor:
        bk = self.layout.buckets[b]
        if self.stage in (0, 1):
            return self.flat_grad.narrow(0, bk.flat_start, bk.numel)
        buf = self.buffers.get(b)
        if buf is None:
            buf = self._take_buffer()
            plan = self.layout.plans[bk.group]
            self.buffers[b] = buf
            if bk.local_index == plan.num_buckets - 1 and plan.padding:
                buf.narrow(0, bk.numel - plan.padding, plan.padding).zero_()
        # Pool buffers fit the largest group's bucket; groups may use smaller ones.
        return buf.narrow(0, 0, bk.numel)

    def _take_buffer(self) -> torch.Tensor:
        # Fill the whole pool before waiting: with two buffers one bucket fills while the
        # previous one is being reduced. Past that, wait for the oldest reduction to free its
        # buffer; allocate beyond the pool only when nothing is in flight (buckets held back
        # behind an earlier, incomplete one), which the optimizer counts.
        if not self.pool:
            if self.allocated >= self.pool_size and self.inflight:
                self._wait_oldest()
            if not self.pool:
                self.allocated += 1
                return self.alloc_bucket()
        return self.pool.pop()

    def _wait_oldest(self) -> None:
        work, buf, bk = self.inflight.pop(0)
        work.wait()
        self._finish(buf, bk)

    def _drain(self) -> None:
        while self.inflight:
            self._wait_oldest()

    def _reduce_ready(self) -> None:
        while self.next_bucket < len(self.layout.buckets) and self.pending[self.next_bucket] == 0:
            self._reduce(self.next_bucket)
            self.next_bucket += 1

    def _reduce(self, b: int) -> None:
        bk = self.layout.buckets[b]
        src = self._bucket_tensor(b)
        label = f"bucket {b} (group {bk.group}, {bk.numel} elements)"
        if self.stage == 0:
            work = self.comm.all_reduce(src, label, async_op=self.overlap)
            if work is not None:
                self.inflight.append((work, src, bk))
            else:
                src.div_(self.comm.world_size)
            return
        if self.stage == 1:
            mine = src.narrow(0, self.comm.rank * bk.shard_numel, bk.shard_numel)
            if self.overlap and self.comm.in_place_scratch():
                # Each in-place exchange holds a receive buffer until it completes: keep at
                # most two in flight, a constant budget like stage 2's pool.
                while len(self.inflight) >= 2:
                    self._wait_oldest()
            work = self.comm.reduce_scatter(mine, src, label, async_op=self.overlap)
            if work is not None:
                self.inflight.append((work, src, bk))
            else:
                self._finish(src, bk)
            return
        shard = self.grad_shard.narrow(0, bk.shard_start, bk.shard_numel)
        accumulate = self.stage == 2 and self.reduced_once[b]
        self.reduced_once[b] = True
        out = torch.empty_like(shard) if accumulate else shard
        work = self.comm.reduce_scatter(out, src, label, async_op=self.overlap)
        if work is not None and not accumulate:
            self.inflight.append((work, src, bk))
            return
        if work is not None:
            work.wait()
        out.div_(self.comm.world_size)
        if accumulate:
            shard.add_(out)
        self._release(b, src)

    def _finish(self, buf: torch.Tensor, bk: Bucket) -> None:
        if self.stage == 0:  # all-reduced in place
            buf.div_(self.comm.world_size)
            return
        if self.stage == 1:  # keep this rank's summed slice, zero the others
            n, r = self.comm.world_size, self.comm.rank
            v = buf.view(n, bk.shard_numel)
            if r > 0:
                v[:r].zero_()
            if r < n - 1:
                v[r + 1:].zero_()
            return
        self.grad_shard.narrow(0, bk.shard_start, bk.shard_numel).div_(self.comm.world_size)
        self._release(bk.index, buf)

    def _release(self, b: int, buf: torch.Tensor) -> None:
        if self.stage == 2:
            self.pool.append(self.buffers.pop(b))

    def flush(self) -> None:
        """Before the optimizer step: reduce every bucket not yet reduced, in order, with
        zeros where this rank produced no gradient; then wait for in-flight collectives."""
        if self.sync:
            self._flush_round()
        self._drain()

    def _flush_round(self) -> None:
        if self.next_bucket < len(self.layout.buckets):
            for b in range(self.next_bucket, len(self.layout.buckets)):
                if self.pending[b]:
                    dst = self._bucket_tensor(b)
                    for i in self._missing(b):
                        if self.stage != 2 and self.got_grad[i]:
                            continue  # stage 0/1: the flat slot holds an earlier round's sum
                        for fb, boff, _, n in self.frags[i]:
                            if fb == b:
                                dst.narrow(0, boff, n).zero_()
                    self.pending[b] = 0
            self._reduce_ready()

    def _missing(self, b: int) -> list[int]:
        bk = self.layout.buckets[b]
        order = self.layout.orders[bk.group]
        frags = self.layout.plans[bk.group].bucket_fragments(bk.local_index)
        return [order[f.param_index] for f in frags if order[f.param_index] not in self.filled[b]]
