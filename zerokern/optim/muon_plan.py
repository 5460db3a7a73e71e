"""Which rank owns which Muon matrix: a pure, deterministic plan (no torch, no communication).

Muon's update of a matrix is a Newton-Schulz iteration on the whole matrix, so the matrix
cannot be split across ranks the way an elementwise AdamW step can. Instead each matrix (or
each declared block of one: the rows of one head of a fused QKV weight) gets one owner rank,
which receives the fully reduced gradient, keeps the momentum, runs Newton-Schulz once and
sends the new values back (torchtitan's DistMuon assigns whole matrices the same way).

Owners are balanced by Newton-Schulz cost, ``rows * cols * min(rows, cols)`` (the gram matrix
and the two products of every iteration are that many multiply-adds, up to a constant), with
greedy LPT: units in decreasing cost, each to the rank with the least cost so far. Every tie
is broken deterministically (units by index; equally loaded ranks by their cost of the unit's
own shape, then by rank: equal-cost shapes like a tall and a wide matrix need not take equal
time, so each shape is spread over the ranks rather than each given to one), so every rank
computes the same plan from the same shapes. LPT's makespan is at most (4/3 - 1/(3N)) of
the optimum, and at most the mean load plus the largest single cost.

Each owner's units are laid out in one contiguous segment, grouped by shape so that a group
of same-shape units (a :class:`Batch`) is one ``(k, rows, cols)`` view of the segment, ready
for a batched Newton-Schulz. Every segment is padded to the largest one, ``segment_numel``,
so a reduce-scatter over ``world_size`` equal segments hands each owner exactly the sum of
its own units (zerokern.comm.owner_exchange).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction


def ns_cost(rows: int, cols: int) -> int:
    """Newton-Schulz cost of a ``rows x cols`` matrix: ``rows * cols * min(rows, cols)``.

    Args:
        rows: the matrix's first dim.
        cols: the matrix's second dim.

    Returns:
        The cost, in multiply-adds up to a constant factor.

    >>> ns_cost(4, 8)
    128
    """
    return rows * cols * min(rows, cols)


@dataclass(frozen=True)
class Unit:
    """One matrix, or one block of rows of it, that Muon orthogonalizes on its own.

    Attributes:
        index: position in :attr:`MuonPlan.units` (matrices in order, blocks in row order).
        matrix: index of the matrix (the parameter) it belongs to.
        block: index of the block within its matrix (0 when the matrix is not split).
        row_start: first row of the block in the matrix.
        rows: rows of the block.
        cols: columns (the matrix's).
        owner: the rank that updates it.
        offset: where its elements start in its owner's segment.
    """

    index: int
    matrix: int
    block: int
    row_start: int
    rows: int
    cols: int
    owner: int = -1
    offset: int = -1

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)``."""
        return (self.rows, self.cols)

    @property
    def numel(self) -> int:
        """``rows * cols``."""
        return self.rows * self.cols

    @property
    def cost(self) -> int:
        """Its Newton-Schulz cost, :func:`ns_cost`."""
        return ns_cost(self.rows, self.cols)


@dataclass(frozen=True)
class Batch:
    """Same-shape units of one owner, adjacent in its segment: one ``(k, rows, cols)`` view.

    Attributes:
        shape: ``(rows, cols)`` of every unit.
        units: the units' indices, in segment order.
        offset: where the first unit starts in the owner's segment.
    """

    shape: tuple[int, int]
    units: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        """Elements of the whole batch."""
        return len(self.units) * self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class MuonPlan:
    """Owners, segment layout and batches of a set of matrices over ``world_size`` ranks.

    Attributes:
        world_size: the number of ranks.
        shapes: the matrices' shapes, as given.
        units: every unit, in order (matrix by matrix, blocks in row order).
        batches: per rank, its batches in segment order.
        loads: per rank, the Newton-Schulz cost of the units it owns.
        owned_numel: per rank, the elements of the units it owns.
        segment_numel: the largest ``owned_numel``: every rank's segment is this long.
    """

    world_size: int
    shapes: tuple[tuple[int, int], ...]
    units: tuple[Unit, ...]
    batches: tuple[tuple[Batch, ...], ...]
    loads: tuple[int, ...]
    owned_numel: tuple[int, ...]
    segment_numel: int

    def owned(self, rank: int) -> list[Unit]:
        """The units ``rank`` owns, in segment order."""
        return [self.units[i] for b in self.batches[rank] for i in b.units]

    def units_of(self, matrix: int) -> list[Unit]:
        """The units of matrix ``matrix``, in row order."""
        return [u for u in self.units if u.matrix == matrix]

    def balance(self) -> dict[str, float | int]:
        """The load balance: ``max`` and ``mean`` cost per rank, ``ratio`` = max / mean (1.0
        when there is no cost at all), ``max_unit`` (the largest single cost) and
        ``padding`` (elements of the segments that hold no unit)."""
        total = sum(self.loads)
        mean = Fraction(total, self.world_size)
        top = max(self.loads)
        return {"max": top, "mean": float(mean),
                "ratio": float(top / mean) if total else 1.0,
                "max_unit": max((u.cost for u in self.units), default=0),
                "padding": self.segment_numel * self.world_size - sum(self.owned_numel)}


def _shape(i: int, s: object) -> tuple[int, int]:
    if (not isinstance(s, Sequence) or len(s) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in s)):
        raise ValueError(f"shapes[{i}] must be (rows, cols) with positive ints: Muon takes "
                         f"2-D matrices, got {s!r}")
    return (s[0], s[1])


def _splits(i: int, rows: int, split: object) -> tuple[int, ...]:
    if split is None:
        return (rows,)
    ok = (isinstance(split, Sequence) and len(split) > 0
          and all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in split))
    if not ok or sum(split) != rows:  # type: ignore[arg-type]
        raise ValueError(f"row_splits[{i}] must be positive row counts summing to the "
                         f"matrix's {rows} rows, got {split!r}")
    return tuple(split)  # type: ignore[arg-type]


def plan_muon(shapes: Sequence[Sequence[int]], world_size: int, *,
              row_splits: Mapping[int, Sequence[int]] | None = None) -> MuonPlan:
    """The owner of every matrix (or block), balanced by Newton-Schulz cost with greedy LPT.

    Args:
        shapes: ``(rows, cols)`` of each matrix, in the order every rank lists them.
        world_size: the number of ranks to spread them over.
        row_splits: matrix index -> row counts of its blocks (e.g. ``{0: (64,) * 12}`` for a
            fused 768-row QKV weight split per head); each block is orthogonalized on its own
            and may have its own owner. Matrices not named are one unit.

    Returns:
        The plan; the same on every rank given the same arguments.

    Raises:
        ValueError: a shape that is not two positive ints, a split whose row counts are not
            positive or do not sum to the matrix's rows, a split naming no matrix, or a
            ``world_size`` below 1.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    dims = tuple(_shape(i, s) for i, s in enumerate(shapes))
    splits = dict(row_splits or {})
    bad = sorted(k for k in splits if not (isinstance(k, int) and 0 <= k < len(dims)))
    if bad:
        raise ValueError(f"row_splits names matrices {bad}, but there are {len(dims)}")
    units: list[Unit] = []
    for m, (rows, cols) in enumerate(dims):
        start = 0
        for b, r in enumerate(_splits(m, rows, splits.get(m))):
            units.append(Unit(len(units), m, b, start, r, cols))
            start += r
    # LPT: largest cost first (ties: lower unit index), each to the least-loaded rank (ties:
    # the rank with the least cost of this very shape, then the lower rank: equal-cost
    # shapes such as (4H, H) and (H, 4H) do not take equal time everywhere, so each shape is
    # spread rather than one per rank). Plain integers, so every rank reaches the same plan.
    loads = [0] * world_size
    by_shape: dict[tuple[int, int], list[int]] = {}
    owner = [0] * len(units)
    for u in sorted(units, key=lambda u: (-u.cost, u.index)):
        same = by_shape.setdefault(u.shape, [0] * world_size)
        r = min(range(world_size), key=lambda k: (loads[k], same[k], k))
        owner[u.index] = r
        loads[r] += u.cost
        same[r] += u.cost
    # Each owner's segment: its units grouped by shape (groups in order of their first unit,
    # units by index within a group), so a group is one contiguous (k, rows, cols) view.
    batches: list[tuple[Batch, ...]] = []
    offsets = [0] * len(units)
    numels = []
    for r in range(world_size):
        groups: dict[tuple[int, int], list[int]] = {}
        for u in units:
            if owner[u.index] == r:
                groups.setdefault(u.shape, []).append(u.index)
        mine, pos = [], 0
        for shape, idx in groups.items():
            mine.append(Batch(shape, tuple(idx), pos))
            for i in idx:
                offsets[i] = pos
                pos += units[i].numel
        batches.append(tuple(mine))
        numels.append(pos)
    placed = tuple(Unit(u.index, u.matrix, u.block, u.row_start, u.rows, u.cols,
                        owner[u.index], offsets[u.index]) for u in units)
    return MuonPlan(world_size, dims, placed, tuple(batches), tuple(loads), tuple(numels),
                    max(numels, default=0))


__all__ = ["Batch", "MuonPlan", "Unit", "ns_cost", "plan_muon"]
