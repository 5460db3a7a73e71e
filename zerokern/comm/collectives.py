"""The only module that calls torch.distributed.

`Comm` wraps one process group (or none: world size 1, every collective a local no-op) and
counts what each collective moves, the way the paper counts in §7: the elements of the full
tensor that pass through a reduce-scatter or all-gather once, an all-reduce twice. Errors from
the backend (timeouts, a peer that died) are re-raised naming the collective and its label
(e.g. the bucket), so a failure says where it happened instead of hanging silently.

Tensors handed to the backend. A backend thread (gloo's worker, NCCL's watchdog) keeps a
finished collective's Work, and with it the tensors, for a moment after ``wait()`` returned, and
drops them on its own thread. If the Python object of such a tensor has died by then (a
``narrow`` view made for the call), torch has kept that object alive from C++, and the last
release must take the GIL; during interpreter shutdown that thread is unwound instead and the
process dies in ``std::terminate``: 10 of 400 runs of 2-rank zerokern scripts, and 7 of 40 of
a torch-only script (scripts/repro_gloo_exit.py), all exiting right after their last
collective. So every tensor a collective
gets is a fresh ``detach()`` (same memory, a TensorImpl nobody else references), and its
Python object is kept in ``_INFLIGHT`` until the backend's references are gone (its use count
is back to 1): the backend's release is then never the last one. An ``atexit`` hook, which
runs before finalization, waits with the GIL released until that is true of every tensor.
"""

from __future__ import annotations

import atexit
import os
import pickle
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

# torch 2.14 renamed the flat-tensor collectives (the old names warn); 2.11 has only the old.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_INFLIGHT: list[torch.Tensor] = []
_HANDLES: weakref.WeakSet[Handle] = weakref.WeakSet()  # live handles, for the exit hook
_INFLIGHT_LOCK = threading.Lock()
# How long the exit hook waits for a backend to let go (a collective that never completes,
# e.g. a peer that died, must not hang the exit for ever).
_EXIT_WAIT_S = 10.0


def _prune_locked() -> None:
    _INFLIGHT[:] = [t for t in _INFLIGHT if t._use_count() > 1]


def _hand(t: torch.Tensor) -> torch.Tensor:
    """The tensor object to give the backend: shares ``t``'s memory, is referenced by nobody
    else, and stays alive here until the backend has released it."""
    mine = t.detach()
    with _INFLIGHT_LOCK:
        _prune_locked()
        _INFLIGHT.append(mine)
    return mine


def inflight_count() -> int:
    """Tensors a backend still references (after pruning); 0 once every collective's
    backend thread has let go of its tensors."""
    with _INFLIGHT_LOCK:
        _prune_locked()
        return len(_INFLIGHT)


def wait_released(timeout: float = _EXIT_WAIT_S) -> bool:
    """Wait (GIL released) until no backend references a tensor of ours; False on timeout.

    A Handle nobody waited on (a backward without a step, an exception mid-step) keeps its
    Work, and the Work its tensors: completed ones let go of their Work first. Tensors of
    collectives that never completed (a peer died) are not waited for: their backend thread
    is stuck, not about to release them."""
    stuck: set[int] = set()
    for h in list(_HANDLES):
        if h.is_completed():
            h._works = []
        else:
            stuck.update(id(t) for t in h._tensors)
    deadline = time.monotonic() + timeout
    while True:
        with _INFLIGHT_LOCK:
            _prune_locked()
            if all(id(t) in stuck for t in _INFLIGHT):
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)


atexit.register(wait_released)


def _exact(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


@dataclass
class CommStats:
    """Per-kind totals: elements as the paper counts them, bytes of our tensors, and
    ``wire``: the elements each rank sends under the bandwidth-optimal algorithm, (n-1)/n of
    a reduce-scatter's input or an all-gather's output and 2(n-1)/n of an all-reduce's tensor
    over n ranks (what a link carries; exact fractions). ``replicate``: on a 2-D mesh, the
    replicate dim's own totals (these are the shard dim's)."""

    elements: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wire: dict[str, Fraction] = field(default_factory=lambda: defaultdict(Fraction))
    replicate: CommStats | None = None
    secondary: CommStats | None = None  # hpZ: the node group's (these are every rank's)

    def add(self, kind: str, numel: int, element_size: int, factor: int = 1,
            ranks: int = 1, *, nbytes: int | None = None) -> None:
        """Count one call: ``factor * numel`` elements; their bytes are ``numel *
        element_size`` each time, or ``nbytes`` in all when given (a quantized collective
        moves fewer bytes than its elements' dtype: codes and scales)."""
        self.elements[kind] += factor * numel
        self.bytes[kind] += factor * numel * element_size if nbytes is None else nbytes
        self.calls[kind] += 1
        self.wire[kind] += Fraction(factor * numel * (ranks - 1), ranks)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {
            k: {"elements": self.elements[k], "bytes": self.bytes[k], "calls": self.calls[k],
                "wire_elements": _exact(self.wire[k])}
            for k in sorted(self.calls)
        }


PAPER_KINDS = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all")
"""The collectives the paper counts (§7), and the all-to-all that sends Muon's matrices to
their owners (zerokern.comm.shard_exchange); broadcasts and the step's small all-reduce are
not."""


def _dim_summary(stats: CommStats) -> dict[str, Any]:
    d = stats.as_dict()
    paper = {k: v for k, v in d.items() if k in PAPER_KINDS}
    return {"elements": sum(v["elements"] for v in paper.values()),
            "bytes": sum(v["bytes"] for v in paper.values()),
            "wire_elements": _exact(sum((stats.wire[k] for k in paper), Fraction())),
            "per_kind": d}


def comm_summary(stats: CommStats, numel: int) -> dict[str, Any]:
    """ZeroAdamW.comm_stats() of one step's totals (``stats``, with the replicate dim's on a
    2-D mesh) for a model of ``numel`` trained elements: every dim together (``per_kind``,
    ``elements``, ``bytes`` of the paper's kinds, ``wire_elements``) and ``per_dim``."""
    rep = stats.replicate if stats.replicate is not None else CommStats()
    dims = {"shard": _dim_summary(stats), "replicate": _dim_summary(rep)}
    if stats.secondary is not None:
        # hpZ: the primary collectives span both mesh dims ("world"); the in-node gathers
        # are the shard dim's.
        dims = {"world": dims["shard"], "shard": _dim_summary(stats.secondary),
                "replicate": dims["replicate"]}
    kinds: dict[str, dict[str, Any]] = {}
    for dim in dims.values():
        for k, v in dim["per_kind"].items():
            acc = kinds.setdefault(k, dict.fromkeys(v, 0))
            for field_, x in v.items():
                acc[field_] += x
    return {"per_kind": kinds,
            "elements": sum(d["elements"] for d in dims.values()),
            "bytes": sum(d["bytes"] for d in dims.values()),
            "wire_elements": _exact(sum((st.wire[k] for st in (stats, rep, stats.secondary)
                                         if st is not None
                                         for k in PAPER_KINDS if k in st.calls), Fraction())),
            "numel": numel, "per_dim": dims}


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it and what it was moving."""


class CollectiveTimeout(CollectiveError):
    """``Handle.wait(timeout=...)`` ran out: this rank waited that long for the other ranks to
    join the collective. The collective is still pending in the backend, so its group cannot
    be used again (the process should end)."""

    def __init__(self, message: str, waited: float) -> None:
        super().__init__(message)
        self.waited = waited


class Handle:
    """What an asynchronous collective returns: ``wait()`` waits for the backend's work(s),
    re-raises a backend error as CollectiveError naming the collective, and then runs
    ``finish`` (the point-to-point reduce-scatter sums what it received) once."""

    def __init__(self, works: list[Any], guard: Any, finish: Any = None,
                 tensors: tuple[torch.Tensor, ...] = (), describe: str = "collective") -> None:
        self._works, self._guard, self._finish = works, guard, finish
        self._tensors = tensors  # what was handed to the backend (for the exit hook)
        self._describe = describe  # "<collective> on rank r/n (backend) while moving <label>"
        self._done = False
        _HANDLES.add(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the collective; with ``timeout`` (seconds) raise CollectiveTimeout once
        this call has waited that long. The limit is on this rank's wait for the others, not
        on the collective's age: a prefetched collective started long ago is not penalised."""
        if not self._done:
            with self._guard():
                if timeout is None:
                    for w in self._works:
                        w.wait()
                else:
                    self._wait_for(timeout)
            if self._finish is not None:
                self._finish()
            self._done = True
            self._works, self._tensors = [], ()
            inflight_count()  # prune: what the backend already released is freed now
        return True

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    # Never traced: torch.compile of a stage-3 model runs the units' gathers inside its
    # hooks, and Dynamo cannot trace time.monotonic (a graph break per wait); a clock has
    # no place in a graph anyway. torch._disable_dynamo is torch.compiler.disable applied at
    # the first call (torch's own optimizers use it): the public decorator imports
    # torch._dynamo when this module is imported, 1.5 s of CPU for every process that
    # imports zerokern and never compiles (each rank of a launch, each CLI command).
    @torch._disable_dynamo
    def _wait_for(self, timeout: float) -> None:
        start = time.monotonic()
        deadline = start + timeout
        for w in self._works:
            left = deadline - time.monotonic()
            try:
                # A backend's wait(timeout) raises when the time is up (gloo: "Operation timed
                # out!"); the collective itself stays queued on the backend's thread.
                w.wait(timedelta(seconds=max(left, 0.001)))
            except (RuntimeError, dist.DistError) as exc:
                waited = time.monotonic() - start
                # Raised before the time was up: the collective failed (a peer died). Not
                # is_completed(): gloo's send/recv works report completed after a timeout.
                if time.monotonic() < deadline - 0.05:
                    raise
                raise CollectiveTimeout(
                    f"{self._describe}: waited {waited:.1f} s for the other ranks to join "
                    f"and they did not", waited) from exc


class Comm:
    def __init__(self, process_group: Any = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group if self.distributed else None
        if process_group is not None and not self.distributed:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup (from "
                            f"dist.new_group) or None, got {type(process_group).__name__}")
        launched = os.environ.get("WORLD_SIZE", "1")
        if not self.distributed and launched.isdigit() and int(launched) > 1:
            # torchrun (or another launcher) started several ranks: running each as world
            # size 1 would train N unrelated models without a word.
            raise RuntimeError(
                f"WORLD_SIZE={launched} in the environment but torch.distributed is not "
                f"initialized: call torch.distributed.init_process_group() before building "
                f"ZeroAdamW or calling shard_model")
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
        # On a 2-D mesh (hybrid sharding, zerokern/comm/mesh.py) this Comm is the shard
        # dim's group and ``replicate`` the replicate dim's: gradients reduced here are then
        # summed across it, and the average divides by both sizes (``dp_size``).
        self.replicate: Comm | None = None
        self.mesh_ranks: list[list[int]] | None = None  # the mesh, in global ranks
        # hpZ (shard_model(hpz=True)): this Comm is every rank of the mesh and ``secondary``
        # the node's (mesh dim 1) group, where the backward's gathers stay.
        self.secondary: Comm | None = None
        self.mesh_dim_names: tuple[str, ...] | None = None

    @property
    def dp_size(self) -> int:
        """The data-parallel degree: the ranks whose gradients are averaged (this group's,
        times the replicate group's on a 2-D mesh)."""
        return self.world_size * (self.replicate.world_size if self.replicate else 1)

    def replicate_all_reduce(self, t: torch.Tensor, label: str,
                             async_op: bool = False) -> Handle | None:
        """Hybrid sharding: sum ``t`` (this rank's reduced slice) across the replicate
        group, in place; nothing on a flat group."""
        if self.replicate is None:
            return None
        return self.replicate.all_reduce(t, f"{label} across replicas", async_op=async_op)

    def broadcast_all(self, t: torch.Tensor, label: str) -> None:
        """Every rank of the mesh (or group) takes global rank 0's ``t``: within this group
        from its rank 0, then across the replicate group from its rank 0."""
        self.broadcast(t, 0, label)
        if self.replicate is not None:
            self.replicate.broadcast(t, 0, label)

    def all_gather_object_all(self, obj: Any, label: str = "objects") -> list[Any]:
        """Every rank's ``obj`` over the whole mesh (flat: this group), replica by replica:
        index ``replicate_rank * world_size + rank``."""
        mine = self.all_gather_object(obj, label)
        if self.replicate is None:
            return mine
        return [o for row in self.replicate.all_gather_object(mine, label) for o in row]

    # -- helpers ---------------------------------------------------------------------------
    def reset_stats(self) -> CommStats:
        """This step's totals (with the replicate dim's, on a mesh), and new ones."""
        old, self.stats = self.stats, CommStats()
        if self.replicate is not None:
            old.replicate = self.replicate.reset_stats()
        if self.secondary is not None:
            old.secondary = self.secondary.reset_stats()
        return old

    @contextmanager
    def _guard(self, what: str, label: str) -> Iterator[None]:
        try:
            yield
        except CollectiveError:
            raise  # already says where (CollectiveTimeout)
        except (RuntimeError, dist.DistError) as exc:  # DistBackendError/timeouts included
            raise CollectiveError(
                f"{what} failed on rank {self.rank}/{self.world_size} ({self.backend}) "
                f"while moving {label}: {exc}"
            ) from exc

    def global_rank(self, group_rank: int) -> int:
        if not self.distributed or self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _async(self, what: str, label: str, works: list[Any], tensors: tuple[torch.Tensor, ...],
               async_op: bool, finish: Any = None) -> Handle | None:
        h = Handle(works, lambda: self._guard(what, label), finish, tensors,
                   f"{what} on rank {self.rank}/{self.world_size} ({self.backend}) while "
                   f"moving {label}")
        if async_op:
            return h
        h.wait()
        return None

    # -- collectives -----------------------------------------------------------------------
    def broadcast(self, t: torch.Tensor, src: int = 0, label: str = "tensor") -> None:
        if self.world_size == 1:
            return
        mine = _hand(t)
        with self._guard("broadcast", label):
            work = dist.broadcast(mine, self.global_rank(src), group=self.group, async_op=True)
        self.stats.add("broadcast", t.numel(), t.element_size(), ranks=self.world_size)
        self._async("broadcast", label, [work], (mine,), False)

    def all_reduce(self, t: torch.Tensor, label: str = "tensor", *, count: bool = True,
                   op: Any = None, async_op: bool = False) -> Handle | None:
        """Sum (or `op`) in place. Counted twice, as the paper counts an all-reduce."""
        if self.world_size == 1:
            return None
        mine = _hand(t)
        with self._guard("all_reduce", label):
            work = dist.all_reduce(mine, op=op or dist.ReduceOp.SUM, group=self.group,
                                   async_op=True)
        if count:
            self.stats.add("all_reduce", t.numel(), t.element_size(), factor=2,
                           ranks=self.world_size)
        else:
            self.stats.add("scalar_all_reduce", t.numel(), t.element_size())
        return self._async("all_reduce", label, [work], (mine,), async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, label: str = "bucket",
                       async_op: bool = False) -> Handle | None:
        """out (this rank's 1/N slice) = sum over ranks of inp; counted as inp's numel."""
        if self.world_size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return None
        if inp.numel() != out.numel() * self.world_size:
            raise ValueError(f"reduce_scatter of {label}: input has {inp.numel()} elements, "
                             f"expected {self.world_size} x {out.numel()}")
        if self.p2p_reduce_scatter:
            works, handed, finish = self._exchange_reduce_scatter(out, inp, label)
            h = self._async("reduce_scatter", label, works, handed, async_op, finish)
        else:
            handed = (_hand(out), _hand(inp))
            with self._guard("reduce_scatter", label):
                work = _reduce_scatter(*handed, group=self.group, async_op=True)
            h = self._async("reduce_scatter", label, [work], handed, async_op)
        self.stats.add("reduce_scatter", inp.numel(), inp.element_size(), ranks=self.world_size)
        return h

    def _exchange_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                                 label: str) -> tuple[list[Any], tuple[torch.Tensor, ...], Any]:
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
        works, handed = [], []
        with self._guard("reduce_scatter", label):
            for k in range(1, n):
                dst, src = (r + k) % n, (r - k) % n
                handed += [_hand(chunks[dst]), _hand(bufs[k - 1])]
                works.append(dist.isend(handed[-2], self.global_rank(dst), group=self.group,
                                        tag=self._tag))
                works.append(dist.irecv(handed[-1], self.global_rank(src), group=self.group,
                                        tag=self._tag))

        def finish() -> None:
            if not in_place:
                out.add_(mine)
            for b in bufs[0 if in_place else 1:]:
                out.add_(b)
            self.scratch_bytes -= nscratch

        return works, tuple(handed), finish

    def in_place_scratch(self) -> bool:
        """Whether an in-place reduce-scatter (output = this rank's slice of the input)
        needs a receive buffer: on the point-to-point path it does, NCCL's does not."""
        return self.p2p_reduce_scatter and self.world_size > 1

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, label: str = "shard",
                   async_op: bool = False, *, count: bool = True) -> Handle | None:
        """out (N slices) = concatenation of every rank's inp; counted as out's numel
        (count=False: bookkeeping traffic, not counted)."""
        if self.world_size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return None
        handed = (_hand(out), _hand(inp))
        with self._guard("all_gather", label):
            work = _all_gather(*handed, group=self.group, async_op=True)
        if count:
            self.stats.add("all_gather", out.numel(), out.element_size(),
                           ranks=self.world_size)
        return self._async("all_gather", label, [work], handed, async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, label: str = "chunks",
                   async_op: bool = False, *, count: bool = True) -> Handle | None:
        """Slice r of ``out`` (N equal slices) = slice ``self.rank`` of rank r's ``inp``;
        counted as inp's numel, like a reduce-scatter (count=False: the caller counts)."""
        if self.world_size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return None
        if inp.numel() != out.numel() or inp.numel() % self.world_size:
            raise ValueError(f"all_to_all of {label}: input has {inp.numel()} elements and "
                             f"output {out.numel()}; both must be the same multiple of "
                             f"{self.world_size}")
        handed = (_hand(out), _hand(inp))
        with self._guard("all_to_all", label):
            work = dist.all_to_all_single(*handed, group=self.group, async_op=True)
        if count:
            self.stats.add("all_to_all", inp.numel(), inp.element_size(), ranks=self.world_size)
        return self._async("all_to_all", label, [work], handed, async_op)

    def all_to_all_uneven(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                          in_splits: list[int], label: str = "pieces",
                          async_op: bool = False) -> Handle | None:
        """``inp``'s consecutive chunks of ``in_splits[r]`` elements go to rank r; ``out``'s
        chunks of ``out_splits[r]`` elements come from rank r (``all_to_all_single`` with
        split sizes; gloo and NCCL both take them). Counted as ``all_to_all`` of the
        elements this rank sends to other ranks, exactly (elements and wire alike: nothing
        is padded, and this rank's own chunk, normally 0, never travels). ``async_op``:
        return a :class:`Handle` at once (``out`` holds the result after its ``wait()``;
        neither tensor may be written until then)."""
        if len(out_splits) != self.world_size or len(in_splits) != self.world_size:
            raise ValueError(f"all_to_all of {label}: {len(in_splits)} input and "
                             f"{len(out_splits)} output splits for {self.world_size} ranks")
        if sum(in_splits) != inp.numel() or sum(out_splits) != out.numel():
            raise ValueError(f"all_to_all of {label}: splits {in_splits} -> {out_splits} do "
                             f"not sum to {inp.numel()} -> {out.numel()} elements")
        if self.world_size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return self._async("all_to_all", label, [], (), async_op)
        handed = (_hand(out), _hand(inp))
        with self._guard("all_to_all", label):
            work = dist.all_to_all_single(*handed, list(out_splits), list(in_splits),
                                          group=self.group, async_op=True)
        sent = inp.numel() - in_splits[self.rank]
        self.stats.add("all_to_all", sent, inp.element_size())
        self.stats.wire["all_to_all"] += sent
        return self._async("all_to_all", label, [work], handed, async_op)

    def all_gather_object(self, obj: Any, label: str = "objects", *,
                          timeout: float | None = None) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order. Built on all_gather (sizes, then the
        padded bytes) so its tensors are kept like every other collective's. Like
        torch.distributed.all_gather_object it unpickles what the group's ranks sent.
        ``timeout`` (seconds) bounds each of the two waits as ``Handle.wait`` does
        (CollectiveTimeout): torch's object collectives take none."""
        if self.world_size == 1:
            return [obj]
        data = pickle.dumps(obj)
        dev = self._object_device()
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=dev)
        self._all_gather_within(sizes, size, f"{label} (sizes)", timeout)
        width = int(sizes.max())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = torch.empty(self.world_size * width, dtype=torch.uint8, device=dev)
        self._all_gather_within(gathered, mine.to(dev), label, timeout)
        rows = gathered.cpu().view(self.world_size, width)
        lengths = sizes.cpu().tolist()
        return [pickle.loads(rows[r, : lengths[r]].numpy().tobytes())
                for r in range(self.world_size)]

    def _all_gather_within(self, out: torch.Tensor, inp: torch.Tensor, label: str,
                           timeout: float | None) -> None:
        handle = self.all_gather(out, inp, label=label, count=False, async_op=True)
        if handle is not None:
            handle.wait(timeout=timeout)

    def _object_device(self) -> torch.device:
        # NCCL moves only CUDA tensors; every other backend here takes CPU tensors.
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def barrier(self) -> None:
        if self.world_size > 1:
            with self._guard("barrier", "nothing"):
                dist.barrier(group=self.group)  # the backends make its tensors in C++: none of ours
