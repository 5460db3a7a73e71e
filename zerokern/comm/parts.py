"""The communication parts: how gradients are reduced and parameters gathered, one part per
layout, chosen once from the mesh. The stages (zero/stages/) and stage 3's units
(zero/stage3/) call these verbs and never a collective themselves.

* :class:`FlatReduce` / :class:`HybridReduce`: the gradient-reduce part of a flat group and of
  a 2-D mesh (dim 0 replicate, dim 1 shard). ``reduce`` sums a bucket or a unit within the
  shard group (a reduce-scatter), ``complete`` finishes that sum (across the replicate group
  on a mesh), divides by S * R once and hands it on, ``reduce_full`` / ``finish_full`` give
  every rank the whole averaged bucket (stage 0), ``load`` is the cast into the reduce dtype.
* :class:`FlatGather` / :class:`HybridGather`: the parameter-gather part. ``gather`` is the
  shard group's all-gather (a mesh's replicas hold the same shard: nothing crosses them);
  ``take_initial`` / ``take_initial_slices`` hand the initial values from rank 0 to the shard
  group and then across the replicas.

The cross-replica sum runs asynchronously. ``complete`` starts the all-reduce of one slice
across the replicate group and returns; the slice is averaged and handed on (``then``) at the
next ``complete`` or at ``settle``, in the order the slices came: the sum of one bucket (or
unit) runs while the next one is reduce-scattered and the backward goes on, as FSDP2 runs its
HSDP all-reduce on a stream of its own. Whoever reads the results calls ``settle`` first.
The values are the ones a synchronous sum gives: the same collectives, the same order on
every rank, the same division.

A part reaches the wire through ``_reduce_scatter`` and ``_all_gather`` (FSDP2's swappable
``_reduce_scatter_comm`` / ``_all_gather_comm``), and on a mesh ``_sum_replicas`` (the sum
across the replicate group). A quantized layout (comm/quantized_parts.py, chosen by
``bits``) is one more subclass overriding them; the stages do not change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import ops
from .collectives import Comm, Handle
from .mesh import MeshInfo


class _Across(NamedTuple):
    """A slice whose sum across the replicate group is in flight."""

    handle: Any  # Handle | None (None: done at once)
    t: torch.Tensor
    then: Callable[[], None] | None


class FlatReduce:
    """The gradient-reduce part of a flat group: the shard group is every data-parallel
    rank. ``dtype``: the dtype gradients are summed in (``reduce_dtype``; None: theirs)."""

    def __init__(self, mesh: MeshInfo, dtype: torch.dtype | None = None) -> None:
        self.mesh, self.comm = mesh, mesh.shard
        self.dtype = dtype
        self._pending: deque[_Across] = deque()

    # -- the wire (a quantized part overrides these) -----------------------------------------
    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, label: str,
                        async_op: bool) -> Handle | None:
        return self.comm.reduce_scatter(out, inp, label, async_op=async_op)

    # -- the cast ---------------------------------------------------------------------------
    def load(self, dst: torch.Tensor, srcs: list[torch.Tensor], offsets: list[int], *,
             ranges: list[tuple[int, int]] | None = None, backend: str | None = None) -> None:
        """Gradients ``srcs`` (flat) into ``dst`` at ``offsets`` (``ranges``: (start, numel)
        of each source), in ``dst``'s dtype: the reduce dtype's cast on the copy, else the
        fused flatten; a source that is that part of ``dst`` already stays as it is."""
        spans = ranges if ranges is not None else [(0, s.numel()) for s in srcs]
        todo = [k for k, (s, off) in enumerate(zip(srcs, offsets))
                if s.dtype != dst.dtype or s.data_ptr() + spans[k][0] * s.element_size()
                != dst.data_ptr() + off * dst.element_size()]
        if all(srcs[k].dtype == dst.dtype for k in todo):
            if todo:
                ops.flatten_into_([srcs[k] for k in todo], dst, [offsets[k] for k in todo],
                                  ranges=[spans[k] for k in todo] if ranges is not None
                                  else None, backend=backend)
            return
        for k in todo:
            start, n = spans[k]
            dst.narrow(0, offsets[k], n).copy_(srcs[k].narrow(0, start, n))

    # -- the shard group's sum ----------------------------------------------------------------
    def reduce(self, out: torch.Tensor, inp: torch.Tensor, label: str, *,
               async_op: bool) -> Handle | None:
        """``out`` = this rank's slice of the sum of ``inp`` over the shard group (a
        reduce-scatter; None when it completed at once). ``complete`` finishes it."""
        return self._reduce_scatter(out, inp, label, async_op)

    def complete(self, t: torch.Tensor, label: str,
                 then: Callable[[], None] | None = None) -> None:
        """After ``reduce``'s collective: ``t`` summed over the whole mesh and divided by
        S * R, then ``then()``. On a flat group now."""
        self.average(t)
        if then is not None:
            then()

    def settle(self) -> None:
        """Finish every ``complete`` still in flight (none on a flat group)."""

    @property
    def pending(self) -> int:
        """Cross-replica sums in flight."""
        return len(self._pending)

    def average(self, t: torch.Tensor) -> torch.Tensor:
        """Sum -> mean, in the gradient dtype: the one division of every stage (as DDP
        divides its buckets), by every rank whose gradient went into the sum."""
        n = self.mesh.dp_size
        if n > 1:
            t.div_(n)
        return t

    def sum_across(self, slices: list[tuple[torch.Tensor, str]], *, async_op: bool) -> None:
        """Each (slice, label) summed across the replicate group, all issued before any is
        waited (stage 1 at the step); nothing on a flat group."""

    # -- every rank the whole sum (stage 0) -----------------------------------------------------
    def reduce_full(self, t: torch.Tensor, own: torch.Tensor, label: str, *,
                    async_op: bool) -> Handle | None:
        """Start summing ``t`` in place over the data-parallel group, every rank getting the
        whole (``own``: this rank's slice of it); ``finish_full`` averages it."""
        return self.comm.all_reduce(t, label, async_op=async_op)

    def finish_full(self, t: torch.Tensor, own: torch.Tensor, label: str) -> None:
        """After ``reduce_full``'s collective: the average, on every rank."""
        self.average(t)


class HybridReduce(FlatReduce):
    """The gradient-reduce part of a 2-D mesh: within the shard group as on a flat one, then
    across the replicate group (asynchronously: module docstring), averaged by S * R."""

    def __init__(self, mesh: MeshInfo, dtype: torch.dtype | None = None) -> None:
        assert mesh.replicate is not None
        super().__init__(mesh, dtype)
        self.replicate: Comm = mesh.replicate

    # -- the wire across replicas (a quantized part overrides it) ------------------------------
    def _sum_replicas(self, t: torch.Tensor, label: str, async_op: bool) -> Any:
        """Start ``t`` summed in place across the replicate group (a handle, or None)."""
        return self.replicate.all_reduce(t, label, async_op=async_op)

    def complete(self, t: torch.Tensor, label: str,
                 then: Callable[[], None] | None = None) -> None:
        # One all-reduce per slice and round, issued in the order the slices were reduced, so
        # every replicate group sees the same sequence; the one before is finished after
        # this one was started (both run meanwhile).
        h = self._sum_replicas(t, f"{label} across replicas", True)
        self._pending.append(_Across(h, t, then))
        while len(self._pending) > 1:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        a = self._pending.popleft()
        if a.handle is not None:
            a.handle.wait()
        self.average(a.t)
        if a.then is not None:
            a.then()

    def settle(self) -> None:
        while self._pending:
            self._finish_oldest()

    def sum_across(self, slices: list[tuple[torch.Tensor, str]], *, async_op: bool) -> None:
        handles = [self._sum_replicas(t, f"{label} across replicas", async_op)
                   for t, label in slices]
        for h in handles:
            if h is not None:
                h.wait()

    def reduce_full(self, t: torch.Tensor, own: torch.Tensor, label: str, *,
                    async_op: bool) -> Handle | None:
        # Hierarchical: reduce-scatter within the shard group (in place), the own slice summed
        # across replicas and averaged, all-gathered back (finish_full): the traffic of
        # stages 1-2 per mesh dim.
        return self.reduce(own, t, label, async_op=async_op)

    def finish_full(self, t: torch.Tensor, own: torch.Tensor, label: str) -> None:
        self.complete(own, label, lambda: self.comm.all_gather(
            t, own, f"averaged gradients of {label}"))


class FlatGather:
    """The parameter-gather part of a flat group."""

    def __init__(self, mesh: MeshInfo) -> None:
        self.mesh, self.comm = mesh, mesh.shard

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor, label: str,
                    async_op: bool) -> Handle | None:
        return self.comm.all_gather(out, shard, label, async_op=async_op)

    def gather(self, out: torch.Tensor, shard: torch.Tensor, label: str, *,
               async_op: bool) -> Handle | None:
        """``out`` = every shard-group rank's ``shard``, in rank order (None when it
        completed at once)."""
        return self._all_gather(out, shard, label, async_op)

    def take_initial(self, t: torch.Tensor, label: str) -> None:
        """``t`` from the shard group's rank 0 (setup: the initial values)."""
        self.comm.broadcast(t, 0, label)

    def take_initial_slices(self, t: torch.Tensor, label: str) -> None:
        """``t`` (this rank's slices) from the first replica: nothing on a flat group."""


class HybridGather(FlatGather):
    """The parameter-gather part of a 2-D mesh: gathers stay within the shard group; the
    initial slices come from the first replica."""

    def take_initial_slices(self, t: torch.Tensor, label: str) -> None:
        assert self.mesh.replicate is not None
        self.mesh.replicate.broadcast(t, 0, label)


def reduce_part(comm: Comm, dtype: torch.dtype | None = None,
                bits: int | None = None, feedback: bool = False) -> FlatReduce:
    """The gradient-reduce part of ``comm``'s layout (``dtype``: the reduce dtype; ``bits``:
    8 or 4 for a quantized reduce, quantized_parts.py; ``feedback``: its error feedback)."""
    mesh = MeshInfo.of(comm)
    if bits is not None:
        from .quantized_parts import quantized_reduce_part

        return quantized_reduce_part(mesh, dtype, bits, feedback)
    return HybridReduce(mesh, dtype) if mesh.hybrid else FlatReduce(mesh, dtype)


def gather_part(comm: Comm, bits: int | None = None) -> FlatGather:
    """The parameter-gather part of ``comm``'s layout (``bits``: 8 for a quantized gather,
    quantized_parts.py)."""
    mesh = MeshInfo.of(comm)
    if bits is not None:
        from .quantized_parts import quantized_gather_part

        return quantized_gather_part(mesh, bits)
    return HybridGather(mesh) if mesh.hybrid else FlatGather(mesh)
