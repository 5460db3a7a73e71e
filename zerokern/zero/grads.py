"""Gradient bucketing of stages 0-2: copy each gradient into its bucket as autograd produces
it, and reduce buckets strictly in index order, so that every rank issues the same collectives
in the same order (a bucket that completes early waits for the ones before it; at step() the
remaining buckets are flushed with zeros for gradients this rank never produced).

This file only sequences. Where a bucket's gradients are written, which collective reduces it
and how its result is averaged belong to the stage (``zero/stages/``), behind ``BucketOps``.

A round is one backward's pass over the buckets. Accumulating several backwards without
``no_sync`` makes several rounds per step: a parameter delivered twice starts a new round,
after the previous one has been reduced completely.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .. import ops
from ..comm import Handle
from .layout import Layout


class BucketPhase(enum.Enum):
    EMPTY = "empty"  # nothing delivered in this round
    FILLING = "filling"  # some of its fragments delivered
    FULL = "full"  # every fragment delivered (or zero-filled): waits for the buckets before it
    REDUCING = "reducing"  # its collective is in flight
    REDUCED = "reduced"  # reduced and averaged for this round


@dataclass
class BucketState:
    phase: BucketPhase = BucketPhase.EMPTY
    due: int = 0  # fragments still to be delivered in this round
    delivered: set[int] = field(default_factory=set)  # parameters delivered in this round


class BucketOps(Protocol):
    """What a stage does with a bucket (implemented by the stage-0/1/2 engines)."""

    def bucket_tensor(self, b: int) -> torch.Tensor:
        """Where bucket ``b``'s gradients are written in this round."""

    def start_reduce(self, b: int, src: torch.Tensor, accumulate: bool) -> Handle | None:
        """Start reducing ``src``; None when it finished synchronously (finish_reduce is then
        not called). ``accumulate``: an earlier round of this step was reduced already."""

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        """After the collective completed: average, and give a pool buffer back."""

    def after_delivery(self, index: int) -> None:
        """What becomes of parameter ``index``'s ``.grad`` once copied into its buckets."""

    def keeps_earlier_rounds(self) -> bool:
        """True when a bucket slot keeps an earlier round's sum in place (stages 0-1)."""

    def settle(self) -> None:
        """Finish what finish_reduce left in flight (a mesh's cross-replica sums)."""


class GradReducer:
    def __init__(self, layout: Layout, params: list[torch.nn.Parameter], ops_: BucketOps, *,
                 overlap: bool, backend: str | None, max_inflight: int | None = None) -> None:
        self.layout, self.params, self.ops = layout, params, ops_
        self.backend = backend
        self.overlap = overlap
        # A stage whose in-flight collectives hold scratch memory caps how many run at once.
        self.max_inflight = max_inflight
        # Fragments of every parameter: (bucket, offset in bucket, param offset, numel).
        self.frags: list[list[tuple[int, int, int, int]]] = [[] for _ in params]
        self.frag_count = [0] * len(layout.buckets)
        bstart = 0
        for g, plan in enumerate(layout.plans):
            order = layout.orders[g]
            for f in plan.fragments:
                b = bstart + f.bucket_index
                self.frags[order[f.param_index]].append((b, f.bucket_offset, f.param_offset,
                                                         f.numel))
                self.frag_count[b] += 1
            bstart += plan.num_buckets
        self.sync = True
        self._callback_task = -1  # the backward whose end-of-backward callback is queued
        self.reset()

    # -- per-step state ----------------------------------------------------------------------
    def reset(self, zeroed: bool = False) -> None:
        """Forget everything about the current step (after step(), or zero_grad(): then
        ``zeroed``)."""
        self.rounds = 0  # rounds completed in this step
        # Gradients were cleared since the last step; otherwise a bucket view still on a
        # parameter holds the last step's gradient, and autograd adds the new one to it.
        self.zeroed = zeroed
        self.carried = False  # a parameter's .grad carried the last step's gradient
        self.got_grad = [False] * len(self.params)
        self.inflight: list[tuple[Handle, torch.Tensor, int]] = []
        self._new_round()

    def _new_round(self) -> None:
        self.buckets = [BucketState(due=n) for n in self.frag_count]
        self.cursor = 0  # first bucket not yet reducing or reduced

    def _end_of_backward(self) -> None:
        self.drain()

    # -- hooks ------------------------------------------------------------------------------
    def on_grad_ready(self, index: int, in_backward: bool = True) -> None:
        if not self.sync:
            return  # no_sync: autograd keeps accumulating into param.grad
        task = torch._C._current_graph_task_id() if in_backward else -1
        # Per backward, not a sticky flag: a backward that raised never ran its callback.
        if in_backward and task != self._callback_task:
            # Like DDP's finalize: when this backward ends, wait for its asynchronous
            # collectives, so gradients are final and no bucket is written while in flight.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_task = task
        frags = self.frags[index]
        if self.cursor >= len(self.buckets) or (
            frags and index in self.buckets[frags[0][0]].delivered
        ):
            # Delivered already in this round: a new backward began. Finish the old round
            # first (same collective order on every rank) and wait for it: the new round
            # writes into the same buckets.
            self._flush_round()
            self.drain()
            self.rounds += 1
            self._new_round()
        grad = self.params[index].grad
        if grad is None:
            return
        self.got_grad[index] = True
        flat_g = grad.detach().reshape(-1)
        if not flat_g.is_contiguous():
            flat_g = flat_g.contiguous()
        for b, boff, poff, n in frags:
            dst = self.ops.bucket_tensor(b)
            same = dst.data_ptr() + boff * dst.element_size() == (
                flat_g.data_ptr() + poff * flat_g.element_size()
            )
            if same and self.rounds == 0 and not self.zeroed:
                self.carried = True  # no zero_grad since the last step (torch accumulates)
            if dst.dtype != flat_g.dtype:  # a bucket in the reduce dtype: cast on the copy
                dst.narrow(0, boff, n).copy_(flat_g.narrow(0, poff, n))
            elif not same:  # stage 0/1 after the first round: autograd wrote in place already
                ops.flatten_into_([flat_g], dst, [boff], ranges=[(poff, n)], backend=self.backend)
            st = self.buckets[b]
            st.delivered.add(index)
            st.due -= 1
            st.phase = BucketPhase.FULL if st.due == 0 else BucketPhase.FILLING
            # Reduce (and free) each bucket as soon as it is complete, before taking the
            # next one: a parameter larger than a bucket then streams through the pool.
            self._reduce_ready()
        self.ops.after_delivery(index)

    # -- buckets ----------------------------------------------------------------------------
    def wait_oldest(self) -> None:
        handle, buf, b = self.inflight.pop(0)
        handle.wait()
        self.ops.finish_reduce(b, buf)
        self.buckets[b].phase = BucketPhase.REDUCED

    def drain(self) -> None:
        while self.inflight:
            self.wait_oldest()
        self.ops.settle()

    def _reduce_ready(self) -> None:
        while self.cursor < len(self.buckets) and \
                self.buckets[self.cursor].phase is BucketPhase.FULL:
            self._reduce(self.cursor)
            self.cursor += 1

    def _reduce(self, b: int) -> None:
        if self.max_inflight is not None:
            while len(self.inflight) >= self.max_inflight:
                self.wait_oldest()
        src = self.ops.bucket_tensor(b)
        handle = self.ops.start_reduce(b, src, self.rounds > 0)
        if handle is None:
            self.buckets[b].phase = BucketPhase.REDUCED
        else:
            self.buckets[b].phase = BucketPhase.REDUCING
            self.inflight.append((handle, src, b))

    def flush(self) -> None:
        """Before the optimizer step: reduce every bucket not yet reduced, in order, with
        zeros where this rank produced no gradient; then wait for in-flight collectives."""
        if self.sync:
            self._flush_round()
        self.drain()

    def _flush_round(self) -> None:
        keeps = self.ops.keeps_earlier_rounds()
        for b in range(self.cursor, len(self.buckets)):
            st = self.buckets[b]
            if st.phase in (BucketPhase.EMPTY, BucketPhase.FILLING):
                dst = self.ops.bucket_tensor(b)
                for i in self._missing(b):
                    if keeps and self.got_grad[i]:
                        continue  # the flat slot holds an earlier round's sum
                    for fb, boff, _, n in self.frags[i]:
                        if fb == b:
                            dst.narrow(0, boff, n).zero_()
                st.due, st.phase = 0, BucketPhase.FULL
        self._reduce_ready()

    def _missing(self, b: int) -> list[int]:
        bk = self.layout.buckets[b]
        order = self.layout.orders[bk.group]
        frags = self.layout.plans[bk.group].bucket_fragments(bk.local_index)
        done = self.buckets[b].delivered
        return [order[f.param_index] for f in frags if order[f.param_index] not in done]
