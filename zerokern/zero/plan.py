"""Pure bucket planning for ZeRO gradient reduction and parameter partitioning.

ZeRO keeps gradient-communication memory constant ("constant buffer"): instead of
one flat buffer per model, gradients are reduced through fixed-capacity buckets, so
the buffer size does not grow with the model.  This module decides, without touching
tensors, where every parameter element lives:

* the param group is laid out flat, tightly packed, in gradient-ready order;
* the flat space is cut into buckets of identical capacity ``C`` (only the last one
  is padded), so a parameter may straddle buckets and shards;
* each bucket is split into ``world_size`` equal shards of ``S = C / world_size``;
  rank ``r`` owns ``[r*S, (r+1)*S)`` of every bucket, which is exactly what a
  reduce-scatter over the bucket hands it.

Keeping this pure (no torch, no I/O) makes the layout exhaustively testable and lets
every rank compute the same plan independently.  Everything is a frozen dataclass
holding tuples, so plans are hashable and comparable across ranks.
"""

from __future__ import annotations

import operator
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

__all__ = ["BucketPlan", "Fragment", "ShardPiece", "UnitPlan"]
__all__ += ["plan_buckets", "plan_units", "round_bucket_numel"]


def _as_int(value: object, name: str) -> int:
    """Coerce an integer-like argument; bools and floats are rejected as likely bugs."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _positive(value: object, name: str) -> int:
    v = _as_int(value, name)
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


def _numels(numels: Sequence[int], name: str) -> tuple[int, ...]:
    """Validate per-parameter sizes; zero is allowed (such params get no pieces)."""
    try:
        items = list(numels)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints") from None
    out = []
    for i, n in enumerate(items):
        v = _as_int(n, f"{name}[{i}]")
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
        out.append(v)
    return tuple(out)


def _prefix(numels: tuple[int, ...],
            starts_at: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], int]:
    """Start offset of each parameter in the packed flat space, and where the last ends.

    ``starts_at[i]``: parameter i starts on a multiple of this many elements (1: packed
    tightly); the gap before it is padding. Compressed optimizer state needs its parameters'
    256-element quantization blocks to start where the layout's blocks do.
    """
    if starts_at is None or all(a == 1 for a in starts_at):
        ends = tuple(accumulate(numels, initial=0))
        return ends[:-1], ends[-1]
    offsets, pos = [], 0
    for n, a in zip(numels, starts_at, strict=True):
        pos = -(-pos // a) * a
        offsets.append(pos)
        pos += n
    return tuple(offsets), pos


def _aligns(param_align: Sequence[int] | None, n: int, name: str) -> tuple[int, ...] | None:
    if param_align is None:
        return None
    out = tuple(_positive(a, f"{name}[{i}]") for i, a in enumerate(param_align))
    if len(out) != n:
        raise ValueError(f"{name} must have one entry per parameter ({n}), got {len(out)}")
    return out


def _check_rank(rank: object, world_size: int) -> int:
    r = _as_int(rank, "rank")
    if not 0 <= r < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {r}")
    return r


@dataclass(frozen=True, slots=True)
class Fragment:
    """The piece of one parameter that lies in one bucket.

    ``bucket_numel`` is carried so ``flat_offset`` needs no reference to the plan.
    """

    param_index: int
    param_offset: int
    bucket_index: int
    bucket_offset: int
    numel: int
    bucket_numel: int

    @property
    def flat_offset(self) -> int:
        return self.bucket_index * self.bucket_numel + self.bucket_offset


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """The piece of one parameter that lies in one rank's shard of one bucket.

    ``local_offset`` indexes the rank's concatenated shard buffer, where bucket ``b``'s
    shard occupies ``[b*S, (b+1)*S)``; this is the rank's optimizer-state layout.
    """

    param_index: int
    param_offset: int
    bucket_index: int
    local_offset: int
    numel: int


def _pieces(
    numels: tuple[int, ...],
    offsets: tuple[int, ...],
    lo: int,
    hi: int,
    base: int,
    bucket_index: int,
    out: list[ShardPiece],
) -> None:
    """Append pieces of params intersecting flat range [lo, hi), placed at ``base``.

    Uses bisection so the cost is O(log P + pieces), not O(P) per shard.
    """
    n = len(numels)
    i = bisect_right(range(n), lo, key=lambda j: offsets[j] + numels[j])
    while i < n and offsets[i] < hi:
        start = max(offsets[i], lo)
        stop = min(offsets[i] + numels[i], hi)
        if stop > start:
            out.append(
                ShardPiece(i, start - offsets[i], bucket_index, base + start - lo, stop - start)
            )
        i += 1


@dataclass(frozen=True)
class BucketPlan:
    """Layout of one param group into equal-capacity buckets; build via ``plan_buckets``."""

    numels: tuple[int, ...]
    world_size: int
    alignment: int
    bucket_numel: int
    num_buckets: int
    param_offsets: tuple[int, ...]
    fragments: tuple[Fragment, ...]
    span: int = -1  # where the last parameter ends (gaps included); -1: total_numel

    def __post_init__(self) -> None:
        if self.span < 0:
            object.__setattr__(self, "span", self.total_numel)
        # Cheap O(1) consistency checks; the O(n) derivation lives in plan_buckets.
        if self.bucket_numel < 1 or self.bucket_numel % (self.world_size * self.alignment):
            raise ValueError("bucket_numel must be a positive multiple of world_size*alignment")
        if len(self.param_offsets) != len(self.numels):
            raise ValueError("param_offsets must have one entry per parameter")
        if self.num_buckets != -(-self.span // self.bucket_numel):
            raise ValueError("num_buckets must be ceil(span / bucket_numel)")

    @property
    def total_numel(self) -> int:
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        return self.num_buckets * self.bucket_numel

    @property
    def padding(self) -> int:
        """Padding elements: the gaps before aligned parameters and the end of the last
        bucket."""
        return self.padded_numel - self.total_numel

    @property
    def tail_padding(self) -> int:
        """Padding elements at the end of the last bucket."""
        return self.padded_numel - self.span

    @property
    def shard_numel(self) -> int:
        return self.bucket_numel // self.world_size

    @property
    def local_numel(self) -> int:
        """Size of each rank's concatenated shard buffer (identical on all ranks)."""
        return self.num_buckets * self.shard_numel

    def _check_bucket(self, b: object) -> int:
        bi = _as_int(b, "bucket_index")
        if not 0 <= bi < self.num_buckets:
            raise ValueError(f"bucket_index must be in [0, {self.num_buckets}), got {bi}")
        return bi

    def bucket_fragments(self, b: int) -> tuple[Fragment, ...]:
        """Fragments in bucket ``b``, in bucket order (contiguous in ``fragments``)."""
        b = self._check_bucket(b)
        frags = self.fragments
        lo = bisect_right(frags, b - 1, key=lambda f: f.bucket_index)
        hi = bisect_right(frags, b, key=lambda f: f.bucket_index)
        return frags[lo:hi]

    def param_fragments(self, i: int) -> tuple[Fragment, ...]:
        """Fragments of parameter ``i`` in parameter order; empty for 0-sized params."""
        i = _as_int(i, "param_index")
        if not 0 <= i < len(self.numels):
            raise ValueError(f"param_index must be in [0, {len(self.numels)}), got {i}")
        frags = self.fragments
        lo = bisect_right(frags, i - 1, key=lambda f: f.param_index)
        hi = bisect_right(frags, i, key=lambda f: f.param_index)
        return frags[lo:hi]

    def shard_range(self, rank: int, b: int) -> tuple[int, int]:
        """``[start, stop)`` of ``rank``'s shard inside bucket ``b``."""
        r = _check_rank(rank, self.world_size)
        self._check_bucket(b)
        s = self.shard_numel
        return r * s, (r + 1) * s

    def rank_pieces(self, rank: int) -> tuple[ShardPiece, ...]:
        """Every parameter piece ``rank`` owns, ordered by ``local_offset``."""
        r = _check_rank(rank, self.world_size)
        c, s = self.bucket_numel, self.shard_numel
        out: list[ShardPiece] = []
        for b in range(self.num_buckets):
            lo = b * c + r * s
            _pieces(self.numels, self.param_offsets, lo, lo + s, b * s, b, out)
        return tuple(out)

    def owner_of(self, flat_offset: int) -> tuple[int, int]:
        """``(rank, local_offset)`` holding flat element ``flat_offset`` (padding included)."""
        f = _as_int(flat_offset, "flat_offset")
        if not 0 <= f < self.padded_numel:
            raise ValueError(f"flat_offset must be in [0, {self.padded_numel}), got {f}")
        b, within = divmod(f, self.bucket_numel)
        r, off = divmod(within, self.shard_numel)
        return r, b * self.shard_numel + off


def round_bucket_numel(requested: int, world_size: int, alignment: int = 1) -> int:
    """Round ``requested`` up to a valid capacity: a multiple of world_size*alignment.

    A request of 0 yields the minimum valid capacity, one world_size*alignment.
    """
    req = _as_int(requested, "requested")
    if req < 0:
        raise ValueError(f"requested must be >= 0, got {req}")
    unit = _positive(world_size, "world_size") * _positive(alignment, "alignment")
    return max(unit, -(-req // unit) * unit)


def plan_buckets(
    numels: Sequence[int], world_size: int, bucket_numel: int, alignment: int = 1,
    param_align: Sequence[int] | None = None,
) -> BucketPlan:
    """Plan the flat, bucketed layout of one param group.

    ``numels`` must be in gradient-ready order so buckets fill (and can be reduced)
    as backward progresses.  ``bucket_numel`` must be a positive multiple of
    ``world_size * alignment`` so every shard is equal and aligned; use
    ``round_bucket_numel`` to get one. ``param_align[i]`` (default all 1): parameter i
    starts on a multiple of that many elements of the flat space.
    """
    sizes = _numels(numels, "numels")
    world = _positive(world_size, "world_size")
    align = _positive(alignment, "alignment")
    c = _as_int(bucket_numel, "bucket_numel")
    if c < 1 or c % (world * align):
        raise ValueError(
            f"bucket_numel must be a positive multiple of world_size*alignment "
            f"({world}*{align}={world * align}), got {c}"
        )
    offsets, total = _prefix(sizes, _aligns(param_align, len(sizes), "param_align"))
    frags: list[Fragment] = []
    for i, (start, n) in enumerate(zip(offsets, sizes, strict=True)):
        pos, end = start, start + n
        while pos < end:  # one iteration per bucket the parameter touches
            b, within = divmod(pos, c)
            take = min(end - pos, c - within)
            frags.append(Fragment(i, pos - start, b, within, take, c))
            pos += take
    return BucketPlan(
        numels=sizes,
        world_size=world,
        alignment=align,
        bucket_numel=c,
        num_buckets=-(-total // c),
        param_offsets=offsets,
        fragments=tuple(frags),
        span=total,
    )


@dataclass(frozen=True)
class UnitPlan:
    """Stage-3 layout of one unit (e.g. a module): packed, padded, split evenly by rank.

    Unlike gradient buckets, a unit is gathered whole, so it is one padded flat space
    and rank ``r`` owns the contiguous slice ``[r*S, (r+1)*S)``.
    """

    numels: tuple[int, ...]
    world_size: int
    alignment: int
    param_offsets: tuple[int, ...]
    padded_numel: int

    @property
    def total_numel(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.total_numel

    def rank_pieces(self, rank: int) -> tuple[ShardPiece, ...]:
        """Pieces ``rank`` owns, ``local_offset`` into its shard, ``bucket_index`` 0."""
        r = _check_rank(rank, self.world_size)
        s = self.shard_numel
        out: list[ShardPiece] = []
        _pieces(self.numels, self.param_offsets, r * s, (r + 1) * s, 0, 0, out)
        return tuple(out)


def plan_units(
    unit_numels: Sequence[Sequence[int]], world_size: int, alignment: int = 1,
    param_align: Sequence[Sequence[int]] | None = None,
) -> tuple[UnitPlan, ...]:
    """Plan each stage-3 unit; padding to world_size*alignment keeps shards equal and aligned.
    ``param_align[u][i]``: parameter i of unit u starts on a multiple of that many elements
    of the unit's flat space (default 1)."""
    world = _positive(world_size, "world_size")
    align = _positive(alignment, "alignment")
    unit = world * align
    try:
        units = list(unit_numels)
    except TypeError:
        raise TypeError("unit_numels must be a sequence of sequences of ints") from None
    plans = []
    for u, numels in enumerate(units):
        sizes = _numels(numels, f"unit_numels[{u}]")
        aligns = None if param_align is None else _aligns(param_align[u], len(sizes),
                                                           f"param_align[{u}]")
        offsets, total = _prefix(sizes, aligns)
        plans.append(UnitPlan(sizes, world, align, offsets, -(-total // unit) * unit))
    return tuple(plans)
