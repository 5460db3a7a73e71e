"""The only module that calls torch.distributed.

`Comm` wraps one process group (or none: world size 1, every collective a local no-op) and
counts what each collective moves, the way the paper counts in §7: the elements of the full
tensor that pass through a reduce-scatter or all-gather once, an all-reduce twice. Errors from
the backend (timeouts, a peer that died) are re-raised naming the collective and its label
(e.g. the bucket), so a failure says where it happened instead of hanging silently.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch 2.14 renamed the flat-tensor collectives (the old names warn); 2.11 has only the old.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommStats:
    """Per-kind totals: elements as the paper counts them, bytes on the wire of our tensors."""

    elements: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, numel: int, element_size: int, factor: int = 1) -> None:
        self.elements[kind] += factor * numel
        self.bytes[kind] += factor * numel * element_size
        self.calls[kind] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            k: {"elements": self.elements[k], "bytes": self.bytes[k], "calls": self.calls[k]}
            for k in sorted(self.calls)
        }


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it and what it was moving."""


class _ExchangeWork:
    """Handle of a point-to-point reduce-scatter: wait() waits for every send and receive,
    then sums the received contributions into the output (on the waiting thread)."""

    def __init__(self, works: list[Any], finish: Any, guard: Any) -> None:
        self._works, self._finish, self._guard = works, finish, guard
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            with self._guard():
                for w in self._works:
                    w.wait()
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)


class Comm:
    def __init__(self, process_group: Any = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group if self.distributed else None
        if process_group is not None and not self.distributed:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.backend = dist.get_backend(self.group) if self.distributed else "none"
        self.stats = CommStats()
        # gloo has no reduce-scatter of its own: reduce_scatter_tensor runs an all-reduce of
        # the whole input and keeps a slice, moving twice the bytes a reduce-scatter needs.
        # There each rank instead sends every peer that peer's slice and sums what it
        # receives (point to point, (N-1)/N of the input out and in: 2.5-3x faster for
        # 7M-element buckets on 2 ranks here). NCCL (and others) use their native collective.
        self.p2p_reduce_scatter = self.backend == "gloo"
        self._tag = 0
        # Receive buffers of point-to-point reduce-scatters in flight (bytes now, and the
        # most ever held at once): transient, but memory all the same, so it is reported.
        self.scratch_bytes = self.scratch_peak = 0

    # -- helpers ---------------------------------------------------------------------------
    def reset_stats(self) -> CommStats:
        old, self.stats = self.stats, CommStats()
        return old

    @contextmanager
    def _guard(self, what: str, label: str) -> Iterator[None]:
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:  # DistBackendError/timeouts included
            raise CollectiveError(
                f"{what} failed on rank {self.rank}/{self.world_size} ({self.backend}) "
                f"while moving {label}: {exc}"
            ) from exc

    def global_rank(self, group_rank: int) -> int:
        if not self.distributed or self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- collectives -----------------------------------------------------------------------
    def broadcast(self, t: torch.Tensor, src: int = 0, label: str = "tensor") -> None:
        if self.world_size == 1:
            return
        with self._guard("broadcast", label):
            dist.broadcast(t, self.global_rank(src), group=self.group)
        self.stats.add("broadcast", t.numel(), t.element_size())

    def all_reduce(self, t: torch.Tensor, label: str = "tensor", *, count: bool = True,
                   op: Any = None, async_op: bool = False) -> Any:
        """Sum (or `op`) in place. Counted twice, as the paper counts an all-reduce."""
        if self.world_size == 1:
            return None
        with self._guard("all_reduce", label):
            work = dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group,
                                   async_op=async_op)
        if count:
            self.stats.add("all_reduce", t.numel(), t.element_size(), factor=2)
        else:
            self.stats.add("scalar_all_reduce", t.numel(), t.element_size())
        return work

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, label: str = "bucket",
                       async_op: bool = False) -> Any:
        """out (this rank's 1/N slice) = sum over ranks of inp; counted as inp's numel."""
        if self.world_size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return None
        if inp.numel() != out.numel() * self.world_size:
            raise ValueError(f"reduce_scatter of {label}: input has {inp.numel()} elements, "
                             f"expected {self.world_size} x {out.numel()}")
        if self.p2p_reduce_scatter:
            work = self._exchange_reduce_scatter(out, inp, label)
            if not async_op:
                work.wait()
                work = None
        else:
            with self._guard("reduce_scatter", label):
                work = _reduce_scatter(out, inp, group=self.group, async_op=async_op)
        self.stats.add("reduce_scatter", inp.numel(), inp.element_size())
        return work

    def _exchange_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                                 label: str) -> _ExchangeWork:
        n, r, s = self.world_size, self.rank, out.numel()
        chunks = inp.reshape(n, s)  # a view: inp is a contiguous flat buffer
        mine = chunks[r]
        in_place = out.data_ptr() == mine.data_ptr()
        # The first contribution is received straight into `out` (no scratch for 2 ranks)
        # unless `out` is this rank's own slice of the input, which must be read first.
        extra = n - 1 if in_place else n - 2
        scratch = torch.empty((extra, s), dtype=out.dtype, device=out.device) if extra else None
        nscratch = extra * s * out.element_size()
        self.scratch_bytes += nscratch
        self.scratch_peak = max(self.scratch_peak, self.scratch_bytes)
        bufs = ([] if in_place else [out]) + (list(scratch.unbind(0)) if extra else [])
        # Every rank issues its exchanges in the same order, so one tag per call is the same
        # on all ranks and keeps overlapping calls (several buckets in flight) apart.
        self._tag = (self._tag + 1) % (1 << 30)
        works = []
        with self._guard("reduce_scatter", label):
            for k in range(1, n):
                dst, src = (r + k) % n, (r - k) % n
                works.append(dist.isend(chunks[dst], self.global_rank(dst), group=self.group,
                                        tag=self._tag))
                works.append(dist.irecv(bufs[k - 1], self.global_rank(src), group=self.group,
                                        tag=self._tag))

        def finish() -> None:
            if not in_place:
                out.add_(mine)
            for b in bufs[0 if in_place else 1:]:
                out.add_(b)
            self.scratch_bytes -= nscratch

        return _ExchangeWork(works, finish, lambda: self._guard("reduce_scatter", label))

    def in_place_scratch(self) -> bool:
        """Whether an in-place reduce-scatter (output = this rank's slice of the input)
        needs a receive buffer: on the point-to-point path it does, NCCL's does not."""
        return self.p2p_reduce_scatter and self.world_size > 1

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, label: str = "shard",
                   async_op: bool = False) -> Any:
        """out (N slices) = concatenation of every rank's inp; counted as out's numel."""
        if self.world_size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return None
        with self._guard("all_gather", label):
            work = _all_gather(out, inp, group=self.group, async_op=async_op)
        self.stats.add("all_gather", out.numel(), out.element_size())
        return work

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._guard("all_gather_object", "parameter signatures"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


