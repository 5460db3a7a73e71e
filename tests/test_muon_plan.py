"""zerokern.optim.muon_plan: owners of Muon's matrices, balanced by Newton-Schulz cost.

Properties (hypothesis): the plan is deterministic, covers every matrix's rows exactly once
with one owner per unit, lays each owner's segment out without overlap and with every batch
one contiguous run of same-shape units, and LPT's load bounds hold: max <= mean + the largest
single cost always, and max <= (4/3 - 1/(3N)) of the optimum (brute force on small cases).
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerokern import formulas
from zerokern.optim.muon_plan import MuonPlan, ns_cost, plan_muon

dims = st.integers(min_value=1, max_value=48)
shapes_st = st.lists(st.tuples(dims, dims), min_size=0, max_size=14)
worlds = st.integers(min_value=1, max_value=9)


@st.composite
def cases(draw):
    shapes = draw(shapes_st)
    splits = {}
    for i, (rows, _) in enumerate(shapes):
        if rows > 1 and draw(st.booleans()):
            cuts = sorted(draw(st.sets(st.integers(1, rows - 1), min_size=1, max_size=4)))
            edges = [0, *cuts, rows]
            splits[i] = tuple(b - a for a, b in itertools.pairwise(edges))
    return shapes, draw(worlds), splits


def _check_layout(plan: MuonPlan) -> None:
    n = plan.world_size
    for m, (rows, cols) in enumerate(plan.shapes):  # every row of every matrix, once
        us = plan.units_of(m)
        assert [u.row_start for u in us] == list(itertools.accumulate(
            [0] + [u.rows for u in us[:-1]]))
        assert sum(u.rows for u in us) == rows and all(u.cols == cols for u in us)
    assert [u.index for u in plan.units] == list(range(len(plan.units)))
    seen = []
    for r in range(n):
        spans = []
        for b in plan.batches[r]:
            pos = b.offset
            for i in b.units:  # a batch: same shape, adjacent, in segment order
                u = plan.units[i]
                assert u.owner == r and u.shape == b.shape and u.offset == pos
                spans.append((u.offset, u.offset + u.numel))
                pos += u.numel
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no overlap
        assert plan.owned_numel[r] == sum(u.numel for u in plan.owned(r))
        assert plan.loads[r] == sum(u.cost for u in plan.owned(r))
        assert len({b.shape for b in plan.batches[r]}) == len(plan.batches[r])
        seen += [u.index for u in plan.owned(r)]
    assert sorted(seen) == list(range(len(plan.units)))  # every unit exactly one owner
    assert plan.segment_numel == max(plan.owned_numel)
    assert all(0 <= u.owner < n for u in plan.units)


@settings(max_examples=150, deadline=None)
@given(cases())
def test_plan_covers_once_and_lays_out_segments(case):
    shapes, world, splits = case
    _check_layout(plan_muon(shapes, world, row_splits=splits))


@settings(max_examples=100, deadline=None)
@given(cases())
def test_plan_is_deterministic(case):
    shapes, world, splits = case
    a = plan_muon(shapes, world, row_splits=splits)
    b = plan_muon([list(s) for s in shapes], world,
                  row_splits={k: list(v) for k, v in reversed(list(splits.items()))})
    assert a == b


@settings(max_examples=150, deadline=None)
@given(cases())
def test_lpt_max_load_within_mean_plus_largest_unit(case):
    shapes, world, splits = case
    plan = plan_muon(shapes, world, row_splits=splits)
    total = sum(plan.loads)
    biggest = max((u.cost for u in plan.units), default=0)
    assert max(plan.loads) * world <= total + world * biggest  # exact, in integers
    bal = plan.balance()
    assert bal["max"] == max(plan.loads) and bal["max_unit"] == biggest
    assert bal["padding"] == world * plan.segment_numel - sum(u.numel for u in plan.units)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(dims, dims), min_size=1, max_size=7), st.integers(2, 3))
def test_lpt_within_four_thirds_of_optimum(shapes, world):
    plan = plan_muon(shapes, world)
    costs = [u.cost for u in plan.units]
    opt = min(max(sum(c for c, r in zip(costs, assign) if r == k) for k in range(world))
              for assign in itertools.product(range(world), repeat=len(costs)))
    assert Fraction(max(plan.loads)) <= (Fraction(4, 3) - Fraction(1, 3 * world)) * opt


def test_examples():
    # Four equal matrices on two ranks: two each; one segment per rank, one batch each.
    plan = plan_muon([(8, 4)] * 4, 2)
    assert [u.owner for u in plan.units] == [0, 1, 0, 1]
    assert plan.batches[0][0].units == (0, 2) and plan.segment_numel == 64
    assert plan.balance()["ratio"] == 1.0
    # The largest first, to the least-loaded rank (ties: the lower rank).
    plan = plan_muon([(2, 2), (16, 16), (4, 4), (8, 8)], 2)
    assert [u.owner for u in plan.units] == [1, 0, 1, 1]
    assert plan.loads == (4096, 8 + 64 + 512)
    # More ranks than matrices: the rest own nothing and hold padding.
    plan = plan_muon([(3, 5), (5, 3)], 4)
    assert plan.owned_numel == (15, 15, 0, 0) and plan.balance()["padding"] == 30
    # A fused QKV split per head: each block its own unit, spread over the ranks.
    plan = plan_muon([(12, 4)], 3, row_splits={0: (4, 4, 4)})
    assert [(u.row_start, u.owner) for u in plan.units] == [(0, 0), (4, 1), (8, 2)]
    assert ns_cost(4, 8) == formulas.muon_ns_cost(4, 8) == 4 * 8 * 4


def test_equal_cost_shapes_spread():
    """A GPT block's MLP matrices (4H x H) and (H x 4H) cost the same, but a tall and a wide
    matrix need not take the same time (on a CPU they do not): equally loaded ranks take the
    one with less of the unit's own shape, so each shape is split over the ranks, not one
    shape per rank (before: every 512 x 128 on rank 0, every 128 x 512 on rank 1)."""
    shapes = [(384, 128), (128, 128), (512, 128), (128, 512)] * 6
    for world in (2, 3):
        plan = plan_muon(shapes, world)
        for shape in set(shapes):
            per_rank = [sum(u.shape == shape for u in plan.owned(r)) for r in range(world)]
            assert per_rank == [6 // world] * world, (world, shape, per_rank)
        assert plan.balance()["ratio"] == 1.0 and plan == plan_muon(shapes, world)
    assert plan_muon([], 3).segment_numel == 0


@pytest.mark.parametrize("shapes, world, splits, match", [
    ([(3,)], 2, None, r"shapes\[0\]"),
    ([(4, 4), (2, 3, 4)], 2, None, r"shapes\[1\]"),
    ([(0, 4)], 2, None, r"shapes\[0\]"),
    ([(4, 4)], 0, None, "world_size"),
    ([(4, 4)], 2, {0: (3, 2)}, r"row_splits\[0\]"),
    ([(4, 4)], 2, {0: (4, 0)}, r"row_splits\[0\]"),
    ([(4, 4)], 2, {1: (2, 2)}, "row_splits names matrices"),
])
def test_refusals_name_the_argument(shapes, world, splits, match):
    with pytest.raises(ValueError, match=match):
        plan_muon(shapes, world, row_splits=splits)


def test_exchange_formulas_follow_the_plan():
    plan = plan_muon([(8, 12), (8, 8), (4, 20)], 3)
    got = formulas.muon_exchange_elements(list(plan.owned_numel))
    s = plan.segment_numel
    assert got == {"reduce_scatter": 3 * s, "all_gather": 3 * s, "wire": 4 * s,
                   "padding": 3 * s - (96 + 64 + 80)}
    assert formulas.muon_exchange_elements([10]) == dict.fromkeys(got, 0)
    mem = formulas.muon_owner_memory_bytes(list(plan.owned_numel), 2, 4, 2)
    assert mem == {"momentum": 4 * plan.owned_numel[2], "grad_buffer": 4 * 3 * s,
                   "param_buffer": 2 * 3 * s}
    with pytest.raises(ValueError, match="owned_numels"):
        formulas.muon_exchange_elements([])
    with pytest.raises(ValueError, match="rank"):
        formulas.muon_owner_memory_bytes([1, 2], 2)


def test_shard_exchange_formula_counts_what_changes_rank():
    # held[r][o]: rank r holds 10 of owner 0's elements and 6 of owner 1's; rank 1 holds 4
    # of owner 0's and 12 of its own. Rank 0 sends owner 1 its 6 and, as owner, rank 1's
    # runs back (4); rank 1 sends 4 and 6.
    held = [[10, 6], [4, 12]]
    assert formulas.muon_shard_exchange_elements(held, 0) == {
        "to_owners": 6, "from_owners": 4, "all_to_all": 10, "wire": 10, "padding": 0}
    assert formulas.muon_shard_exchange_elements(held, 1)["all_to_all"] == 4 + 6
    assert formulas.muon_shard_exchange_elements([[7]], 0)["all_to_all"] == 0
    for bad, match in (([[1, 2]], "held"), ([[1, -1], [0, 0]], "held"),
                       ([[True, 0], [0, 0]], "held")):
        with pytest.raises(ValueError, match=match):
            formulas.muon_shard_exchange_elements(bad, 0)
    with pytest.raises(ValueError, match="rank"):
        formulas.muon_shard_exchange_elements(held, 2)
