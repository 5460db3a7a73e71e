"""The engine's accounting at world sizes 1 to 8, each rank in turn in this process under torch's
fake process group (tests/fake_pg.py): memory_stats() against the paper's formulas per stage,
placement and dtype, comm_stats() element counts, padding, which elements each rank owns, and
refusals that need a group but no collective's result.

Nothing here depends on what a collective computes (under the fake group the trained values
are meaningless); the checks that do (parity with torch AdamW, DDP, checkpoints) stay on gloo
ranks in the other files. Where those files asserted a sum over ranks through all_reduce (each
element owned once), the ranks' numbers are collected here one rank after another and summed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from fake_pg import each_rank, fake_group
from models import Block, OddNet, TinyGPT, batch
from test_offload import _build as _offload_build
from test_offload import _train_step
from test_shards import _build as _shards_build
from test_shards import _step as _shards_step
from test_zero_features import _train

import zerokern
from zerokern.zero.registry import runtime_of_module
from zerokern.zero.shard import runtime_of

# The world sizes the spawning tests ran (1-4) and 8; for the cheapest model one more odd size.
# Each rank runs in turn, so a world size costs as many engine builds as it has ranks.
WORLDS = (1, 2, 3, 4, 8)
WORLDS_ODDNET = (1, 2, 3, 4, 5, 8)




# -- stages 0-2 (from test_zero_features) ------------------------------------------------------
def _accounting(rank, world, stage, dtype):
    torch.manual_seed(0)
    model = OddNet().to(dtype)
    opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, bucket_numel=97)
    e = torch.empty((), dtype=dtype).element_size()
    me = 4 if e == 2 else 0  # the fp32 master of 16-bit parameters (fp32 needs none)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    _train(model, opt, 2, rank)
    ms = opt.memory_stats()
    L = opt.layout
    local = sum(pc.numel for pc in L.pieces)
    if stage == 0:
        assert local == psi
        expect = {"params": e * psi, "grads": e * psi, "master": me * psi,
                  "exp_avg": 4 * psi, "exp_avg_sq": 4 * psi}
    elif stage == 1:  # 4Ψ + 12Ψ/N: the reduce-scatter writes into the full-size gradient
        expect = {"params": e * psi, "grads": e * psi, "master": me * local,
                  "exp_avg": 4 * local, "exp_avg_sq": 4 * local}
    else:  # 2Ψ + 14Ψ/N
        expect = {"params": e * psi, "grads": e * local, "master": me * local,
                  "exp_avg": 4 * local, "exp_avg_sq": 4 * local}
    for k, v in expect.items():
        assert ms[k] == v, (k, ms[k], v)
    pad_elems = L.flat_numel - psi
    assert ms["padding"] >= e * pad_elems
    model_states = sum(ms[k] for k in ("params", "grads", "master", "exp_avg", "exp_avg_sq"))
    assert ms["arena_in_use"] >= model_states + ms["padding"]
    cap = max(b.numel for b in L.buckets)
    if stage == 2:
        assert 0 < ms["buckets"] <= 2 * cap * e  # constant budget: at most two buckets
    # gloo's point-to-point reduce-scatter: stage 1 (in place) receives into at most two
    # bucket slices at once; stage 2 needs receive buffers only beyond 2 ranks.
    if stage == 1 and world > 1:
        assert 0 < ms["comm_scratch"] <= 2 * (world - 1) * (cap // world) * e
    elif stage == 2 and world == 2 or stage == 0 or world == 1:
        assert ms["comm_scratch"] == 0
    assert ms["total"] >= ms["arena_in_use"] + ms["comm_scratch"]
    cs = opt.comm_stats()
    # The paper's count: reduce-scatter + all-gather of every bucket (or one all-reduce, x2).
    if world > 1:
        assert cs["elements"] == 2 * L.flat_numel, cs
        assert 0 <= L.flat_numel - psi < len(L.plans) * max(b.numel for b in L.buckets)
        kinds = set(cs["per_kind"]) - {"scalar_all_reduce"}
        assert kinds == ({"all_reduce"} if stage == 0 else {"reduce_scatter", "all_gather"})
    else:
        assert cs["elements"] == 0
    return local, psi


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("world", WORLDS_ODDNET)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_and_comm_stats_match_formulas(stage, world, dtype):
    ranks = each_rank(world, lambda r, w: _accounting(r, w, stage, dtype))
    psi = ranks[0][1]
    # Every element has exactly one owner across ranks (stage 0: every rank owns all).
    assert sum(local for local, _ in ranks) == (psi if stage else psi * world)


# -- stage 3 (from test_stage3) ----------------------------------------------------------------
def _stage3_accounting(rank, world):
    torch.manual_seed(0)
    base = TinyGPT().to(torch.bfloat16)
    psi = sum(p.numel() for p in base.parameters())
    ours = zerokern.shard_model(copy.deepcopy(base), unit_classes=(Block,))
    rt = runtime_of_module(ours)
    padded = sum(u.plan.padded_numel for u in rt.units)
    # Stored parameter bytes are 1/N of the (padded) total on every rank.
    assert rt.local_params.numel() * world == padded
    # Padding: each unit rounds up to world * 256 elements, and parameters large enough for
    # int8 moments start on a 256-element block (under 256 elements of gap each).
    big = sum(1 for p in base.parameters() if p.numel() >= 4096)
    assert 0 <= padded - psi < len(rt.units) * world * 256 + big * 256
    opt = zerokern.ZeroAdamW(ours.parameters(), stage=3)
    for step in range(2):
        x, y = batch(step, rank)
        F.cross_entropy(ours(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    ms = opt.memory_stats()
    local = sum(pc.numel for pc in opt.layout.pieces)
    # 16Ψ/N: 2 (params) + 2 (grads) + 12 (master, m, v) bytes per owned element.
    assert ms["params"] == ms["grads"] == 2 * local
    assert ms["master"] == ms["exp_avg"] == ms["exp_avg_sq"] == 4 * local
    cs = opt.comm_stats()
    if world > 1:  # forward gather + backward gather + gradient reduce-scatter = 3Ψ
        assert cs["elements"] == 3 * padded, (cs, padded)
        assert cs["per_kind"]["all_gather"]["elements"] == 2 * padded
        assert cs["per_kind"]["reduce_scatter"]["elements"] == padded
    # Forward without gradients: gathers and releases, stores nothing.
    with torch.no_grad():
        ours.eval()
        out = ours(batch(0, rank)[0])
        assert out.shape[-1] == 37
        assert all(not u.gathered for u in rt.units)
    return local, psi


@pytest.mark.parametrize("world", WORLDS)
def test_stage3_memory_and_comm_accounting(world):
    ranks = each_rank(world, _stage3_accounting)
    assert sum(local for local, _ in ranks) == ranks[0][1]  # each element owned once


# -- offload (from test_offload) ---------------------------------------------------------------
def _offload_memory(rank, world, stage, offload_params):
    dtype = torch.bfloat16
    model, opt = _offload_build(stage, dtype, True, offload_params=offload_params,
                                bucket_numel=97)
    planned = opt.memory_stats() if stage < 3 else None
    for step in (0, 2):  # every used parameter in use (none holds its bucket back)
        _train_step(model, opt, stage, step, rank, 1)
    ms = opt.memory_stats()
    L = opt.layout
    local_real = sum(pc.numel for pc in L.pieces if pc.param >= 0)
    held = sum(pc.numel for pc in L.pieces)
    # Host: master + exp_avg + exp_avg_sq = 12Ψ/N, the 16-bit gradient shard 2Ψ/N, and two
    # staging slots.
    assert ms["host_master"] == ms["host_exp_avg"] == ms["host_exp_avg_sq"] == 4 * local_real
    assert sum(ms[f"host_{k}"] for k in ("master", "exp_avg", "exp_avg_sq")) == 12 * local_real
    assert ms["master"] == ms["exp_avg"] == ms["exp_avg_sq"] == 0  # none on the device
    if stage < 3:
        psi = sum(p.numel() for p in opt.managed_params)
        slot = max(b.shard_numel for b in L.buckets)
        assert ms["host_grads"] == 2 * local_real
        assert ms["host_staging"] == 2 * slot * 2
        cap = max(b.numel for b in L.buckets)
        pad = (L.flat_numel - psi) * 2
        if stage == 2:  # device: 2Ψ of 16-bit params + the two buckets, nothing else
            assert ms["params"] == 2 * psi and ms["grads"] == 0 and ms["padding"] == pad
            nbuf = ms["buckets"] // (2 * cap)  # one when every reduction ran synchronously
            assert ms["buckets"] == nbuf * 2 * cap and nbuf in (1, 2)
            assert ms["total"] == _r256(2 * L.flat_numel) + nbuf * _r256(2 * cap) \
                + ms["comm_scratch"]
        else:  # stage 1: 2Ψ params + the full-size 2Ψ gradient
            assert ms["params"] == ms["grads"] == 2 * psi and ms["buckets"] == 0
            assert ms["padding"] == 2 * pad
            assert ms["total"] == 2 * _r256(2 * L.flat_numel) + ms["comm_scratch"]
        for k in ("params", "grads", "host_master", "host_grads", "host_staging", "host_total",
                  "arena_capacity"):
            assert planned[k] == ms[k], (k, planned[k], ms[k])
    else:
        rt = runtime_of(model)
        assert ms["host_grads"] == 2 * held
        assert ms["host_staging"] == 2 * 2 * max(u.plan.shard_numel for u in rt.units)
        if offload_params:  # nothing of the model state on the device but gathered units
            assert ms["params"] == 0 and ms["total"] == 0
            assert ms["host_params"] == 2 * held
            assert rt.local_params.device.type == "cpu" and rt.param_arena.device.type == "cpu"
        else:
            assert ms["params"] == 2 * held and ms["host_params"] == 0
            assert ms["total"] == 2 * rt.local_numel
        assert ms["gather_peak"] > 0
    parts = sum(ms[f"host_{k}"] for k in ("master", "exp_avg", "exp_avg_sq", "grads",
                                          "params", "staging", "padding"))
    assert parts <= ms["host_total"] <= parts + 16 * 256
    assert ms["device_total"] == ms["total"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_memory_stats_match_formulas(stage, world):
    each_rank(world, lambda r, w: _offload_memory(r, w, stage, False))


@pytest.mark.parametrize("world", WORLDS)
def test_offload_params_memory_stats(world):
    each_rank(world, lambda r, w: _offload_memory(r, w, 3, True))


# -- per-rank shard ranges (the side-effect-free part of test_shards) ---------------------------
def _ranges(rank, world, stage):
    ours, opt, _, _ = _shards_build(stage, world)
    if stage < 3:
        ms = opt.memory_stats()
        sd = opt.state_dict()
        assert opt.layout is None, "memory_stats()/state_dict() fixed the layout"
        assert sd["state"] == {} and sd["zerokern"]["ready_order"] is None
    _shards_step(ours, opt, 0, rank, world)  # the first step fixes the layout
    if stage < 3:  # what was reported before the first step is what was allocated
        after = opt.memory_stats()
        for k in ("params", "grads", "master", "exp_avg", "exp_avg_sq", "padding"):
            assert ms[k] == after[k], (k, ms[k], after[k])
        assert ms["arena_capacity"] == after["arena_capacity"]
    shards = opt.shards()
    for sh, p in zip(shards, opt.managed_params):
        assert sh.shape == p.shape and sh.numel == p.numel()
    return ({sh.index: sh.numel for sh in shards},
            [(sh.index, r.start, r.numel) for sh in shards for r in sh.ranges])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shard_ranges_cover_every_element_once(stage, world):
    """The ranks' shards() ranges together hold every element exactly once (stage 0: each
    rank holds all of it), and memory_stats() before the first step is what it allocates."""
    ranks = each_rank(world, lambda r, w: _ranges(r, w, stage))
    numels = ranks[0][0]
    assert all(n == numels for n, _ in ranks)
    for index, numel in numels.items():
        count = torch.zeros(numel, dtype=torch.int64)
        for _, rows in ranks:
            for i, start, n in rows:
                if i == index:
                    count[start:start + n] += 1
        assert torch.all(count == (world if stage == 0 else 1)), (index, count)


def _r256(nbytes):
    return -(-nbytes // 256) * 256


# -- refusals (from test_shards) ---------------------------------------------------------------
def _bad_step(rank, world, stage):
    ours, opt, _, _ = _shards_build(stage, world)
    _shards_step(ours, opt, 0, rank, world)
    before = [p.detach().clone() for p in opt.managed_params]
    steps = [sh.step for sh in opt.shards()]
    assert 1 in steps
    with pytest.raises(ValueError, match="step of parameter 0"):
        with opt.edit_shards() as shards:
            for sh in shards:
                sh.step = 7
            shards[0].step = -1
    assert [sh.step for sh in opt.shards()] == steps
    for a, p in zip(before, opt.managed_params):
        assert torch.equal(a, p.detach())


@pytest.mark.parametrize("stage", [0, 2])
def test_edit_shards_refuses_a_bad_step(stage):
    # The fake backend's own reduce-scatter: every value this rank's gradients alone (finite,
    # reproducible), so that "nothing changed" can be asserted with torch.equal.
    each_rank(2, lambda r, w: _bad_step(r, w, stage), gloo_reduce_scatter=False)


# -- the fixture itself ------------------------------------------------------------------------
def test_fake_group_leaves_no_process_group_behind():
    import torch.distributed as dist

    with fake_group(1, 3):
        assert dist.is_initialized() and dist.get_world_size() == 3 and dist.get_rank() == 1
        with pytest.raises(RuntimeError, match="exists already"):
            with fake_group(0, 3):
                pass
        assert zerokern.ZeroAdamW(torch.nn.Linear(3, 2).parameters()).comm.world_size == 3
    assert not dist.is_initialized()
    with pytest.raises(ZeroDivisionError):
        with fake_group(0, 2):
            raise ZeroDivisionError
    assert not dist.is_initialized()
    # Outside the group a ZeroAdamW is world size 1 again.
    assert zerokern.ZeroAdamW(torch.nn.Linear(3, 2).parameters()).comm.world_size == 1
