"""Muon's owner exchange in the accounting, at stages 0-3: ``memory_stats()`` reports the
buffers of the exchange the stage uses as allocated (stage 0: OwnerExchange's two buffers of N
S elements; stages 1-3: ShardExchange's segments and all-to-all buffers), and before the first
step what it will allocate, counted in ``total``, equal to
``zerokern.formulas.muon_exchange_memory_bytes``; and ``comm_stats()`` holds, per kind, the
stage's own collectives of the flat space plus the exchange's bytes by
``zerokern.formulas.muon_exchange_bytes`` (stage 0: the bfloat16 results' all-gather; stages
1-3: the fp32 updates to their owners and the results back, as all-to-alls). The owners come
from an independently built plan and the held table from every rank's shard pieces. One
2-rank gloo launch for stages 0-3, in which the planner's ``--optimizer muon`` numbers for a
GPT-like model are checked against the engine's measured buffers and counted bytes on the demo
GPT of that shape (stage 1, and stage 3 with a unit per block); the CLI's text and JSON in
process."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from dist_utils import run_ranks
from test_zero_muon import MATRICES, MuonNet, _build, _train

import zerokern
from zerokern import formulas
from zerokern.cli import estimate as cli
from zerokern.demo.gpt import GPT, Block, GPTConfig
from zerokern.estimate import estimate
from zerokern.estimate_muon import gpt_block_numels, muon_held, muon_stage3
from zerokern.optim.muon_plan import plan_muon

STAGE0 = ("muon_grad_buffer", "muon_param_buffer")
SHARDED = ("muon_grad_segment", "muon_param_segment", "muon_send", "muon_recv",
           "muon_back_send", "muon_back_recv")


def _muon(stats: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in stats.items() if k.startswith("muon_")}


def _held(om, plan, world: int) -> list[list[int]]:
    """held[r][o]: elements of owner o's matrices in rank r's shard, from every rank's
    pieces (a collective)."""
    rows = [None] * world
    dist.all_gather_object(rows, [(pc.param, pc.numel) for pc in om.layout.pieces
                                  if pc.param >= 0])
    held = [[0] * world for _ in range(world)]
    for r, row in enumerate(rows):
        for param, numel in row:
            held[r][plan.units[param].owner] += numel
    return held


def accounting_case(rank: int, world: int) -> None:
    torch.manual_seed(0)
    base = MuonNet()
    shapes = [tuple(p.shape) for n, p in base.named_parameters() if n in MATRICES]
    plan = plan_muon(shapes, world)
    owned = list(plan.owned_numel)
    for stage in (0, 1, 2, 3):
        model, om, oa = _build(base, stage, MATRICES)
        what = f"stage {stage}"
        before = om.memory_stats()
        _train(model, (om, oa), world, rank, 0, 2)
        held = _held(om, plan, world)
        # Stage 0 holds every element everywhere: held is stages 1-3's table, unused there.
        assert stage == 0 or [sum(h[o] for h in held) for o in range(world)] == owned, held
        want = formulas.muon_exchange_memory_bytes(owned, stage, held, rank)
        assert set(want) == set(STAGE0 if stage == 0 else SHARDED), (what, want)
        assert want["muon_grad_buffer" if stage == 0 else "muon_grad_segment"] > 0, want
        assert stage == 0 or want["muon_send"] + want["muon_recv"] > 0, (what, want)
        assert _muon(before) == want, (what, "before the first step", before)
        after = om.memory_stats()
        assert _muon(after) == want, (what, after)
        rs = om._rule_state
        ex = rs._exchange if stage == 0 else rs._shard
        held_bytes = ([ex.grad_buffer, ex.param_buffer] if stage == 0 else
                      [ex.grad_segment, ex.param_segment, ex._send, ex._recv, ex._back_send,
                       ex._back_recv])
        assert sum(t.numel() * t.element_size() for t in held_bytes) == sum(want.values())
        # The buffers live outside the arena: total is the slot's plus theirs.
        slot = om._slot.memory_stats()
        assert after["total"] == slot["total"] + sum(want.values()), (what, after, slot)
        assert after["device_total"] == after["total"], (what, after)
        kinds = om.comm_stats()["per_kind"]
        m = formulas.muon_exchange_bytes(owned, stage, held, rank)
        flat = om.layout.flat_numel * 4  # fp32 parameters and gradients
        if stage == 0:  # every rank holds every element: only the results travel
            assert "reduce_scatter" not in kinds and "all_to_all" not in kinds, (what, kinds)
            assert kinds["all_gather"]["bytes"] == m["all_gather"] > 0, (what, kinds, m)
            assert kinds["all_reduce"]["bytes"] == 2 * flat, (what, kinds)
            continue
        assert m["all_gather"] == 0 and m["all_to_all"] > 0, (what, m)
        assert kinds["all_to_all"]["bytes"] == m["all_to_all"], (what, kinds, m)
        e = formulas.muon_shard_exchange_elements(held, rank)
        assert kinds["all_to_all"]["wire_elements"] == e["all_to_all"], (what, kinds, e)
        if stage < 3:  # stage 3's own gathers are per unit (tests/test_stage3_*)
            assert kinds["reduce_scatter"]["bytes"] == flat, (what, kinds)
            assert kinds["all_gather"]["bytes"] == flat, (what, kinds)
    gpt_case(rank, world)


def gpt_case(rank: int, world: int) -> None:
    """The planner's Muon section for L=2, H=8 is what the engine holds and moves for the
    demo GPT of that shape (its blocks' matrices under Muon) at stage 1 and at stage 3
    (``shard_model(unit_classes=(Block,))``: the exchange's buffers and bytes, and the
    momentum), on this rank."""
    row = estimate(1536.0, gpus=[world], layers=2, hidden=8, optimizer="muon")["muon"]["rows"][0]
    for stage in (1, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_embd=8, n_head=2, vocab=16, seq=4))
        if stage == 3:
            assert [p.numel() for p in model.blocks[0].parameters()] == gpt_block_numels(8)
            model = zerokern.shard_model(model, unit_classes=(Block,))
        muon = [p for n, p in model.named_parameters()
                if p.ndim == 2 and n.startswith("blocks.")]
        om = zerokern.ZeroOptimizer(muon, torch.optim.Muon, stage=stage, lr=0.02)
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 16, (2, 4), generator=g)
        model(x, x)[1].backward()
        om.step()
        plan = om._rule_state.plan
        shapes = [(24, 8), (8, 8), (32, 8), (8, 32)] * 2
        held = muon_held(shapes, world) if stage == 1 else muon_stage3(2, 8, world)[0]
        assert _held(om, plan, world) == held, stage
        stats, key = om.memory_stats(), f"stage{stage}"
        assert _muon(stats) == row["memory_bytes"][key][rank], (stage, stats, row)
        kinds = om.comm_stats()["per_kind"]
        moved = row["bytes_per_step"][key][rank]
        assert kinds["all_to_all"]["bytes"] == moved["all_to_all"] > 0, (stage, kinds, row)
        if stage == 1:
            assert kinds["all_gather"]["bytes"] == om.layout.flat_numel * 4, (kinds, row)
        else:  # the momentum: this rank's own elements of the matrices, compact
            assert stats["momentum_buffer"] == row["momentum_bytes"][key][rank] > 0, (
                stats, row)


def test_muon_exchange_memory_and_bytes_match_the_formulas(tmp_path):
    run_ranks(2, accounting_case, tmp_path=tmp_path)


def test_formulas_one_rank_and_bad_input():
    for stage in range(4):
        assert formulas.muon_exchange_bytes([240], stage, [[240]]) == {
            "all_gather": 0, "all_to_all": 0, "total": 0, "wire": 0}
    assert formulas.muon_exchange_memory_bytes([240], 0) == {"muon_grad_buffer": 960,
                                                             "muon_param_buffer": 480}
    # One rank at stages 1-3: its segment only, nothing crosses ranks.
    assert formulas.muon_exchange_memory_bytes([240], 2, [[240]]) == {
        "muon_grad_segment": 960, "muon_param_segment": 480, "muon_send": 0, "muon_recv": 0,
        "muon_back_send": 0, "muon_back_recv": 0}
    # held [[10, 6], [4, 10]]: rank 1 sends owner 0 its 4 elements (fp32) and, as owner of
    # 16, sends rank 0 back the 6 it holds (bf16); it receives 6 and gets 4 back.
    assert formulas.muon_exchange_bytes([14, 16], 1, [[10, 6], [4, 10]], 1) == {
        "all_gather": 0, "all_to_all": 4 * 4 + 6 * 2, "total": 28, "wire": 28}
    assert formulas.muon_exchange_memory_bytes([14, 16], 3, [[10, 6], [4, 10]], 1) == {
        "muon_grad_segment": 64, "muon_param_segment": 32, "muon_send": 16, "muon_recv": 24,
        "muon_back_send": 12, "muon_back_recv": 8}
    bad_calls = [(([], 0), "owned_numels"), (([-1], 0), "owned_numels"),
                 (([1.5], 0), "owned_numels"), (([4, 4], 4), "stage"), (([4, 4], 1), "held"),
                 (([4, 4], 1, [[4, 4]]), "held"),
                 (([4, 4], 1, [[4, 0], [0, 3]]), "owned_numels"),
                 (([4, 4], 1, [[4, 0], [0, 4]], 2), "rank")]
    for fn in (formulas.muon_exchange_memory_bytes, formulas.muon_exchange_bytes):
        for args, name in bad_calls:
            _raises(fn, args, name)


def _raises(fn, args, name: str) -> None:
    try:
        fn(*args)
    except ValueError as exc:
        assert name in str(exc), (name, exc)
    else:
        raise AssertionError(f"no ValueError naming {name}")


def test_cli_optimizer_muon(capsys):
    assert cli.main(["--layers", "2", "--hidden", "8", "--gpus", "1", "2", "4",
                     "--optimizer", "muon"]) == 0
    text = capsys.readouterr().out
    assert "Muon owner exchange" in text and "8 hidden matrices, 1,536 parameters" in text
    assert "stages 1-2 GB held" in text and "stage 3 GB held" in text
    # The stage-3 columns of the 2-GPU line: the largest rank's exchange buffers, bytes per
    # step and momentum, as the JSON below gives them.
    line = next(ln.split() for ln in text.splitlines() if ln.split()[:2] == ["2", "768"])
    assert line[-3:] == ["9.216e-06", "2.432e-06", "3.584e-06"], line
    assert cli.main(["--layers", "2", "--hidden", "8", "--gpus", "2", "--optimizer", "muon",
                     "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)["muon"]
    (row,) = rep["rows"]
    # 2 ranks: LPT splits the 8 matrices' NS cost evenly here, 768 elements each.
    assert row["segment_numel"] == 768 and row["padding_numel"] == 0, row
    mem, moved = row["memory_bytes"], row["bytes_per_step"]
    assert mem["stage0"] == [{"muon_grad_buffer": 2 * 768 * 4,
                              "muon_param_buffer": 2 * 768 * 2}] * 2, row
    assert [d["total"] for d in moved["stage0"]] == [2 * 768 * 2] * 2, row
    # Stages 1-2: each rank's shard is half the 1536 elements; what it holds of the other
    # owner's matrices goes there in fp32 and comes back in bf16 (6 bytes an element), and
    # likewise for what the other rank holds of its own.
    held = muon_held([(24, 8), (8, 8), (32, 8), (8, 32)] * 2, 2)
    assert [sum(r) for r in held] == [768, 768] and [sum(c) for c in zip(*held)] == [768, 768]
    for r in range(2):
        away, home = held[r][1 - r], held[1 - r][r]
        assert moved["stage1"][r]["all_to_all"] == 4 * away + 2 * home, (r, row)
        assert sum(mem["stage1"][r].values()) == 6 * (768 + away + home), (r, row)
    assert row["max_bytes_per_step"]["stage1"] == max(d["total"] for d in moved["stage1"])
    # Stage 3: a unit per block, each split in two: rank 0 holds the first half of each
    # block (qkv, proj, the first 192 of fc: 448), rank 1 the rest (64 + 256); the owners
    # split each rank's share evenly. Momentum: each rank's own elements, fp32.
    held3, momentum = muon_stage3(2, 8, 2)
    assert held3 == [[448, 448], [320, 320]] and momentum == [896, 640], (held3, momentum)
    for r in range(2):
        away, home = held3[r][1 - r], held3[1 - r][r]
        assert moved["stage3"][r]["all_to_all"] == 4 * away + 2 * home, (r, row)
        assert sum(mem["stage3"][r].values()) == 6 * (768 + away + home), (r, row)
    assert row["momentum_bytes"]["stage3"] == [4 * 896, 4 * 640], row
    # Without the option, no Muon section; with it but without the shapes, a clear error.
    assert cli.main(["--params", "1e9"]) == 0
    assert "Muon" not in capsys.readouterr().out
    assert cli.main(["--params", "1e9", "--optimizer", "muon"]) == 2
    assert "--optimizer muon needs --layers and --hidden" in capsys.readouterr().err
