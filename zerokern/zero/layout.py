"""Pure layout of a ZeroAdamW instance: every param group's bucket plan placed one after the
other in one flat parameter space and in one local (per-rank) state space.

Flat space: group g occupies [flat_start_g, flat_start_g + padded_numel_g); parameters are
packed in gradient-ready order (reverse of registration: backward produces the last layer's
gradients first), and buckets never mix groups, so one fused launch covers a group's shard.
Local space: this rank's shards, group after group, bucket after bucket. Stage 0 keeps the
whole flat space locally (local == flat).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .plan import BucketPlan, _prefix, plan_buckets, round_bucket_numel

# Shard boundaries fall on multiples of this many elements: 64 bytes of bf16, 128 of fp32,
# so every shard starts aligned for 16-byte vector loads and on a cache line.
ALIGN_ELEMS = 32
DEFAULT_BUCKET_NUMEL = 1 << 21
# A compact stage-3 state keeps each element at its slice offset modulo this many elements:
# 16 bytes of bf16 (32 of fp32), so the state and the slices a kernel reads together share
# their 16-byte phase and take the same vector path as over the whole slice.
STATE_ALIGN_ELEMS = 8


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Bucket:
    index: int  # global bucket index (issue order of its collective)
    group: int
    local_index: int  # bucket index inside its group's plan
    flat_start: int
    numel: int  # capacity C of the group
    shard_start: int  # where this rank's shard of the bucket lives in local space (stage 1-2)
    shard_numel: int


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one parameter held in this rank's local state."""

    param: int  # global managed-parameter index (-1: a frozen parameter's piece, stage 3)
    param_offset: int
    local_start: int
    numel: int
    group: int


@dataclass(frozen=True)
class Layout:
    stage: int
    world_size: int
    rank: int
    plans: tuple[BucketPlan, ...]
    orders: tuple[tuple[int, ...], ...]  # per group: global param indices in plan order
    ready_order: tuple[int, ...]  # all groups' plan orders, concatenated
    group_flat_start: tuple[int, ...]
    group_local_start: tuple[int, ...]
    flat_numel: int
    local_numel: int
    buckets: tuple[Bucket, ...]
    param_flat_offset: tuple[int, ...]  # by global param index
    pieces: tuple[Piece, ...]  # this rank's pieces in local order
    # Stage 3 with a compact state: (local_start, slice_start, numel) of each run of the
    # local space that stands for a run of the runtime's slices (its ``local_params`` and
    # ``local_grads``), in local order (``compact``); else the local space is the slices' own.
    segments: tuple[tuple[int, int, int], ...] = ()
    compact: bool = False

    def to_slice(self, start: int, numel: int) -> int:
        """Where local range [start, start + numel) lies in the runtime's slices (stage 3);
        the range is within one segment (a piece, or a step range inside a run)."""
        if not self.compact or not numel:
            return start if not self.compact else 0
        i = bisect_right(self.segments, start, key=lambda s: s[0]) - 1
        ls, ss, n = self.segments[i]
        assert i >= 0 and start + numel <= ls + n, "a local range across two segments"
        return ss + start - ls

    def to_local(self, slice_start: int) -> int:
        """The local offset of slice element ``slice_start``, which a segment covers."""
        if not self.compact:
            return slice_start
        for ls, ss, n in self.segments:
            if ss <= slice_start < ss + n:
                return ls + slice_start - ss
        raise AssertionError(f"slice element {slice_start} is in no segment")


def build_layout(
    group_param_numels: Sequence[Sequence[int]],
    *,
    stage: int,
    world_size: int,
    rank: int,
    bucket_numel: int | None,
    alignment: int = ALIGN_ELEMS,
    ready_order: Sequence[int] | None = None,
    param_align: Sequence[int] | None = None,
) -> Layout:
    """group_param_numels[g][j]: numel of the j-th managed param of group g (registration
    order). Global param index = running position over groups in that order.

    param_align[i] (by global param index; default all 1): param i starts on a multiple of
    that many elements of the flat space (compressed state: its quantization blocks are the
    layout's). ``alignment`` must then be a multiple of each, so shards start on them too.

    ready_order: global param indices in the order their gradients became ready (observed on
    a first backward); parameters it omits go last. Default: reverse registration order."""
    rank_of = {} if ready_order is None else {int(i): k for k, i in enumerate(ready_order)}
    plans, orders, fstarts, lstarts, buckets = [], [], [], [], []
    param_flat = [0] * sum(len(g) for g in group_param_numels)
    pieces: list[Piece] = []
    first = 0
    flat = local = 0
    for g, numels in enumerate(group_param_numels):
        order = tuple(range(first + len(numels) - 1, first - 1, -1))  # reverse registration
        if rank_of:
            # Observed order first; never-seen parameters after it (they would otherwise hold
            # back every bucket behind them until step()).
            order = tuple(sorted(order, key=lambda i: (rank_of.get(i, len(rank_of)), -i)))
        ready = [numels[i - first] for i in order]
        aligns = None if param_align is None else tuple(param_align[i] for i in order)
        total = _prefix(tuple(ready), aligns)[1]
        unit = world_size * alignment
        cap = round_bucket_numel(bucket_numel or DEFAULT_BUCKET_NUMEL, world_size, alignment)
        # As many buckets as the requested capacity needs, then the smallest equal capacity
        # that holds the group: padding stays under one alignment unit per bucket instead of
        # up to a whole bucket (13.8M parameters in 2^23 buckets: 0.0% instead of 21%).
        nb = max(1, _ceil_div(total, cap))
        cap = min(cap, max(unit, _ceil_div(_ceil_div(total, nb), unit) * unit))
        plan = plan_buckets(ready, world_size, cap, alignment, aligns)
        plans.append(plan)
        orders.append(order)
        fstarts.append(flat)
        lstarts.append(local)
        for j, gi in enumerate(order):
            param_flat[gi] = flat + plan.param_offsets[j]
        for b in range(plan.num_buckets):
            buckets.append(
                Bucket(
                    index=len(buckets), group=g, local_index=b, flat_start=flat + b * cap,
                    numel=cap, shard_start=local + b * plan.shard_numel,
                    shard_numel=plan.shard_numel,
                )
            )
        if stage == 0:
            for f in plan.fragments:
                pieces.append(Piece(order[f.param_index], f.param_offset,
                                    flat + f.flat_offset, f.numel, g))
            local += plan.padded_numel
        else:
            for p in plan.rank_pieces(rank):
                pieces.append(Piece(order[p.param_index], p.param_offset,
                                    local + p.local_offset, p.numel, g))
            local += plan.local_numel
        flat += plan.padded_numel
        first += len(numels)
    pieces.sort(key=lambda p: p.local_start)
    return Layout(
        stage=stage, world_size=world_size, rank=rank, plans=tuple(plans),
        orders=tuple(orders), ready_order=tuple(i for o in orders for i in o),
        group_flat_start=tuple(fstarts), group_local_start=tuple(lstarts),
        flat_numel=flat, local_numel=local, buckets=tuple(buckets),
        param_flat_offset=tuple(param_flat), pieces=tuple(pieces),
    )


def build_stage3_layout(rt: Any, params: Sequence[Any], groups: Sequence[dict],
                        align: int | None = STATE_ALIGN_ELEMS) -> Layout:
    """Stage 3: the local space covers the optimizer's own pieces of the runtime's unit slices.

    Pieces of parameters it does not train (frozen ones, another optimizer's) are holes
    (param -1). With ``align`` the state is compact: each run of its pieces contiguous in the
    slices becomes a segment of the local space, placed at the first offset congruent to its
    slice offset modulo ``align`` (so every element keeps its alignment, and int8 blocks their
    boundaries; the space is never larger than the slices'); a hole is a 0-element piece
    between two segments, so the runs of the step are cut there as before (padding between
    two runs is left out without cutting: the step is by segment). Several optimizers of one
    model thus hold state for their own elements only. ``align=None`` (offload, whose staging
    is by slice), or an optimizer of every parameter of the model: the local space is the
    slices' own."""
    index = {id(p): i for i, p in enumerate(params)}
    group_of = {id(p): g for g, grp in enumerate(groups) for p in grp["params"]}
    raw = []
    for u in rt.units:
        for sp in u.plan.rank_pieces(rt.comm.rank):
            p = u.params[sp.param_index]
            i = index.get(id(p), -1)
            raw.append(Piece(i, sp.param_offset, u.shard_start + sp.local_offset, sp.numel,
                             group_of.get(id(p), -1) if i >= 0 else -1))
    raw.sort(key=lambda p: p.local_start)
    pieces: list[Piece] = []
    segments: list[tuple[int, int, int]] = []
    local_numel = rt.local_numel
    if all(id(p) in index for u in rt.units for p in u.params):
        align = None  # every parameter is the optimizer's: the slices' own space, as always
    if align is None:
        pieces = raw
    else:
        end = 0  # local end of the last segment
        seg: list[int] | None = None  # [local_start, slice_start, numel] of the open segment
        for pc in raw:
            if pc.param < 0:
                if pc.numel and seg is not None:
                    segments.append((seg[0], seg[1], seg[2]))
                    end, seg = seg[0] + seg[2], None
                if pc.numel:
                    pieces.append(Piece(-1, pc.param_offset, end, 0, -1))
                continue
            if seg is not None and pc.numel and pc.local_start != seg[1] + seg[2]:
                # Padding of the slices before it (a unit's end): left out, the run goes on.
                segments.append((seg[0], seg[1], seg[2]))
                end, seg = seg[0] + seg[2], None
            if seg is None:
                if not pc.numel:
                    pieces.append(Piece(pc.param, pc.param_offset, end, 0, pc.group))
                    continue
                start = end + (pc.local_start - end) % align
                seg = [start, pc.local_start, 0]
            seg[2] = max(seg[2], pc.local_start + pc.numel - seg[1])  # 0-element: inside
            pieces.append(Piece(pc.param, pc.param_offset, seg[0] + pc.local_start - seg[1],
                                pc.numel, pc.group))
        if seg is not None:
            segments.append((seg[0], seg[1], seg[2]))
            end = seg[0] + seg[2]
        local_numel = _ceil_div(end, align) * align  # whole blocks, as the slices hold
    return Layout(
        stage=3, world_size=rt.comm.world_size, rank=rt.comm.rank, plans=(), orders=(),
        ready_order=(), group_flat_start=(), group_local_start=(), flat_numel=0,
        local_numel=local_numel, buckets=(), param_flat_offset=(), pieces=tuple(pieces),
        segments=tuple(segments), compact=align is not None,
    )
