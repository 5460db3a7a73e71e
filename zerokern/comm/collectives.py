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
        with self._guard("reduce_scatter", label):
            work = _reduce_scatter(out, inp, group=self.group, async_op=async_op)
        self.stats.add("reduce_scatter", inp.numel(), inp.element_size())
        return work

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


