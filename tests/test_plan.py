"""Exhaustive checks of the pure bucket planner against a brute-force per-element model."""

from __future__ import annotations

import itertools
import random

import pytest

from zerokern.zero.plan import (
    BucketPlan,
    Fragment,
    ShardPiece,
    UnitPlan,
    plan_buckets,
    plan_units,
    round_bucket_numel,
)

SIZES = (0, 1, 3, 5, 8, 13)
REQUESTS = (1, 6, 16)


def _elements(numels):
    """Flat element f -> (param, offset): the tightly packed layout, by brute force."""
    return [(p, k) for p, n in enumerate(numels) for k in range(n)]


def _check_plan(numels, world, align, c):
    plan = plan_buckets(numels, world, c, align)
    elems = _elements(numels)
    total = len(elems)
    s = c // world
    assert plan.numels == tuple(numels)
    assert plan.bucket_numel == c and c % (world * align) == 0
    assert plan.shard_numel == s and s * world == c and s % align == 0
    assert plan.total_numel == total
    assert plan.num_buckets == -(-total // c)
    assert plan.padded_numel == plan.num_buckets * c >= total
    assert plan.padding == plan.padded_numel - total
    assert plan.padding < c or plan.num_buckets == 0
    assert plan.local_numel == plan.num_buckets * s
    assert plan.param_offsets == tuple(sum(numels[:i]) for i in range(len(numels)))

    # Fragments: ordered by flat offset, each within one bucket, tile the flat data.
    covered = []
    prev = -1
    for fr in plan.fragments:
        assert fr.numel > 0 and fr.bucket_numel == c
        assert 0 <= fr.bucket_offset and fr.bucket_offset + fr.numel <= c
        assert fr.flat_offset > prev
        prev = fr.flat_offset
        for j in range(fr.numel):
            f = fr.flat_offset + j
            assert elems[f] == (fr.param_index, fr.param_offset + j)
            assert f // c == fr.bucket_index
            covered.append(f)
    assert covered == list(range(total))

    # Each parameter tiled exactly once, in order.
    for i, n in enumerate(numels):
        frs = plan.param_fragments(i)
        assert frs == tuple(fr for fr in plan.fragments if fr.param_index == i)
        pos = 0
        for fr in frs:
            assert fr.param_offset == pos
            pos += fr.numel
        assert pos == n

    # Buckets: full capacity except the last, which alone carries padding.
    for b in range(plan.num_buckets):
        frs = plan.bucket_fragments(b)
        assert frs == tuple(fr for fr in plan.fragments if fr.bucket_index == b)
        used = sum(fr.numel for fr in frs)
        assert used == (c if b < plan.num_buckets - 1 else c - plan.padding)
        ranges = [plan.shard_range(r, b) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == c
        for (_, a1), (b0, _) in zip(ranges, ranges[1:], strict=False):
            assert a1 == b0
        for a0, a1 in ranges:
            assert a1 - a0 == s and a0 % align == 0

    # owner_of against the brute-force (bucket, rank) model, padding included.
    def brute_owner(f):
        b, w = divmod(f, c)
        return w // s, b * s + w % s

    for f in range(plan.padded_numel):
        assert plan.owner_of(f) == brute_owner(f)

    # rank_pieces of all ranks together tile every parameter exactly once.
    seen = {}
    for r in range(world):
        pieces = plan.rank_pieces(r)
        locs = [p.local_offset for p in pieces]
        assert locs == sorted(locs)
        for p in pieces:
            assert p.numel > 0
            assert p.bucket_index * s <= p.local_offset
            assert p.local_offset + p.numel <= (p.bucket_index + 1) * s
            for j in range(p.numel):
                key = (p.param_index, p.param_offset + j)
                assert key not in seen
                seen[key] = (r, p.local_offset + j)
    assert len(seen) == total
    for f, key in enumerate(elems):
        assert seen[key] == brute_owner(f)
    return plan


def _capacities(world, align):
    return sorted({round_bucket_numel(q, world, align) for q in REQUESTS})


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("align", [1, 2, 4])
def test_exhaustive_small_grid(world, align):
    caps = _capacities(world, align)
    for length in range(1, 5):
        for numels in itertools.product(SIZES, repeat=length):
            for c in caps:
                _check_plan(list(numels), world, align, c)


def test_random_lists():
    rng = random.Random(1234)
    for _ in range(300):
        world = rng.randint(1, 8)
        align = rng.choice([1, 2, 4, 8])
        numels = [rng.choice([0, 0, 1, rng.randint(1, 40), rng.randint(40, 200)])]
        numels += [rng.randint(0, 60) for _ in range(rng.randint(0, 15))]
        c = round_bucket_numel(rng.randint(0, 150), world, align)
        _check_plan(numels, world, align, c)


def test_empty_and_zero_sized():
    for numels in ([], [0], [0, 0, 0]):
        plan = _check_plan(numels, 2, 2, 8)
        assert plan.num_buckets == 0 and plan.fragments == () and plan.padding == 0
        assert plan.rank_pieces(1) == () and plan.local_numel == 0
        with pytest.raises(ValueError, match="flat_offset"):
            plan.owner_of(0)
    plan = plan_buckets([0, 3, 0], 1, 4)
    assert plan.param_fragments(0) == () and plan.param_fragments(2) == ()


def test_large_param_spans_buckets():
    plan = _check_plan([2, 50, 1], 4, 2, 8)
    frs = plan.param_fragments(1)
    assert len(frs) == 7 and [f.bucket_index for f in frs] == list(range(7))
    assert frs[0] == Fragment(1, 0, 0, 2, 6, 8)


def test_constant_capacity_independent_of_model_size():
    c = round_bucket_numel(1000, 4, 8)
    small = plan_buckets([10] * 10, 4, c, 8)
    big = plan_buckets([10] * 100_000, 4, c, 8)
    assert small.bucket_numel == big.bucket_numel == c
    assert big.num_buckets == -(-1_000_000 // c)
    assert big.padding < c


def test_large_plan_pieces_cover_rank_shards():
    # A realistic size (10^5 parameters): every rank's pieces fill its shards exactly up to
    # the padding at the end of the last bucket. Build time is a benchmark matter, not a test.
    rng = random.Random(7)
    numels = [rng.randint(0, 5000) for _ in range(100_000)]
    plan = plan_buckets(numels, 8, round_bucket_numel(1 << 20, 8, 16), 16)
    owned = sum(sum(p.numel for p in plan.rank_pieces(r)) for r in range(8))
    assert owned == plan.total_numel


def test_hashable_and_comparable():
    a = plan_buckets([3, 5, 8], 2, 8, 2)
    b = plan_buckets((3, 5, 8), 2, 8, 2)
    assert a == b and hash(a) == hash(b) and isinstance(a, BucketPlan)
    assert a != plan_buckets([3, 5, 8], 2, 16, 2)
    assert isinstance(a.rank_pieces(0)[0], ShardPiece)
    assert len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.bucket_numel = 4  # type: ignore[misc]


def test_round_bucket_numel():
    assert round_bucket_numel(0, 4, 2) == 8
    assert round_bucket_numel(1, 4, 2) == 8
    assert round_bucket_numel(8, 4, 2) == 8
    assert round_bucket_numel(9, 4, 2) == 16
    assert round_bucket_numel(100, 3) == 102
    for req in range(0, 50):
        for w in range(1, 5):
            for a in (1, 2, 4):
                c = round_bucket_numel(req, w, a)
                assert c % (w * a) == 0 and c >= max(req, 1) and c - (w * a) < max(req, 1)
    with pytest.raises(ValueError, match="requested"):
        round_bucket_numel(-1, 2)
    with pytest.raises(ValueError, match="world_size"):
        round_bucket_numel(4, 0)
    with pytest.raises(ValueError, match="alignment"):
        round_bucket_numel(4, 1, 0)
    with pytest.raises(TypeError, match="requested"):
        round_bucket_numel(4.0, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "exc", "name"),
    [
        (([1, -1], 2, 4), ValueError, r"numels\[1\]"),
        (([1, 2.0], 2, 4), TypeError, r"numels\[1\]"),
        (([True], 1, 4), TypeError, r"numels\[0\]"),
        ((5, 1, 4), TypeError, "numels"),
        (([1], 0, 4), ValueError, "world_size"),
        (([1], 1.0, 4), TypeError, "world_size"),
        (([1], 2, 6, 2), ValueError, "bucket_numel"),
        (([1], 2, 0), ValueError, "bucket_numel"),
        (([1], 2, -4), ValueError, "bucket_numel"),
        (([1], 2, 4.0), TypeError, "bucket_numel"),
        (([1], 2, 4, 0), ValueError, "alignment"),
        (([1], 2, 4, "1"), TypeError, "alignment"),
    ],
)
def test_plan_buckets_errors(args, exc, name):
    with pytest.raises(exc, match=name):
        plan_buckets(*args)


def test_method_argument_errors():
    plan = plan_buckets([3, 5], 2, 4)
    with pytest.raises(ValueError, match="rank"):
        plan.rank_pieces(2)
    with pytest.raises(ValueError, match="rank"):
        plan.shard_range(-1, 0)
    with pytest.raises(ValueError, match="bucket_index"):
        plan.shard_range(0, 2)
    with pytest.raises(ValueError, match="bucket_index"):
        plan.bucket_fragments(-1)
    with pytest.raises(ValueError, match="param_index"):
        plan.param_fragments(2)
    with pytest.raises(ValueError, match="flat_offset"):
        plan.owner_of(8)
    with pytest.raises(ValueError, match="flat_offset"):
        plan.owner_of(-1)


def _check_units(units, world, align):
    plans = plan_units(units, world, align)
    assert len(plans) == len(units)
    for numels, up in zip(units, plans, strict=True):
        assert isinstance(up, UnitPlan)
        elems = _elements(numels)
        total = len(elems)
        assert up.numels == tuple(numels) and up.total_numel == total
        assert up.param_offsets == tuple(sum(numels[:i]) for i in range(len(numels)))
        assert up.padded_numel % (world * align) == 0
        assert total <= up.padded_numel < total + world * align
        assert up.padding == up.padded_numel - total
        s = up.shard_numel
        assert s * world == up.padded_numel and s % align == 0
        seen = {}
        for r in range(world):
            pieces = up.rank_pieces(r)
            locs = [p.local_offset for p in pieces]
            assert locs == sorted(locs)
            for p in pieces:
                assert p.bucket_index == 0 and p.numel > 0
                assert 0 <= p.local_offset and p.local_offset + p.numel <= s
                for j in range(p.numel):
                    key = (p.param_index, p.param_offset + j)
                    assert key not in seen
                    seen[key] = r * s + p.local_offset + j
        assert seen == {key: f for f, key in enumerate(elems)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("align", [1, 2, 4])
def test_plan_units_grid(world, align):
    units = [list(n) for length in range(0, 4) for n in itertools.product(SIZES, repeat=length)]
    _check_units(units, world, align)


def test_plan_units_errors():
    assert plan_units([], 2) == ()
    with pytest.raises(ValueError, match=r"unit_numels\[1\]\[0\]"):
        plan_units([[1], [-1]], 2)
    with pytest.raises(TypeError, match="unit_numels"):
        plan_units(3, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        plan_units([[1]], 0)
    with pytest.raises(ValueError, match="alignment"):
        plan_units([[1]], 1, 0)
    with pytest.raises(ValueError, match="rank"):
        plan_units([[1]], 2)[0].rank_pieces(2)
