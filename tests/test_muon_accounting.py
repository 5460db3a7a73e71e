"""Muon's owner exchange in the accounting: ``memory_stats()`` reports the exchange's two
buffers as allocated (and before the first step what it will allocate), counted in ``total``,
equal to ``zerokern.formulas.muon_exchange_memory_bytes`` of an independently built plan; and
``comm_stats()`` holds, per kind, the stage's own collectives of the flat space plus the
exchange's bytes by ``zerokern.formulas.muon_exchange_bytes`` (fp32 updates to their owners,
bfloat16 results back). One 2-rank gloo launch for stages 0-3, in which the planner's
``--optimizer muon`` numbers for a GPT-like model are checked against the engine's measured
buffers and counted bytes on the demo GPT of that shape; the CLI's text and JSON in process."""

from __future__ import annotations

import json

import torch
from dist_utils import run_ranks
from test_zero_muon import MATRICES, MuonNet, _build, _train

import zerokern
from zerokern import formulas
from zerokern.cli import estimate as cli
from zerokern.demo.gpt import GPT, GPTConfig
from zerokern.estimate import estimate
from zerokern.optim.muon_plan import plan_muon

KINDS = ("muon_grad_buffer", "muon_param_buffer")


def _muon(stats: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in stats.items() if k.startswith("muon_")}


def accounting_case(rank: int, world: int) -> None:
    torch.manual_seed(0)
    base = MuonNet()
    shapes = [tuple(p.shape) for n, p in base.named_parameters() if n in MATRICES]
    owned = list(plan_muon(shapes, world).owned_numel)
    want = formulas.muon_exchange_memory_bytes(owned)
    assert set(want) == set(KINDS) and want["muon_grad_buffer"] > 0, want
    moved = {s: formulas.muon_exchange_bytes(owned, s) for s in range(4)}
    for stage in (0, 1, 2, 3):
        model, om, oa = _build(base, stage, MATRICES)
        what = f"stage {stage}"
        before = om.memory_stats()
        assert _muon(before) == want, (what, "before the first step", before)
        _train(model, (om, oa), world, rank, 0, 2)
        after = om.memory_stats()
        assert _muon(after) == want, (what, after)
        # The buffers live outside the arena: total is the slot's plus theirs.
        slot = om._slot.memory_stats()
        assert after["total"] == slot["total"] + sum(want.values()), (what, after, slot)
        assert after["device_total"] == after["total"], (what, after)
        if stage == 3:
            continue  # stage 3's own gathers are per unit (tests/test_stage3_*)
        kinds = om.comm_stats()["per_kind"]
        flat = om.layout.flat_numel * 4  # fp32 parameters and gradients
        m = moved[stage]
        if stage == 0:  # every rank holds every element: only the results travel
            assert "reduce_scatter" not in kinds, (what, kinds)
            assert kinds["all_gather"]["bytes"] == m["all_gather"], (what, kinds, m)
            assert kinds["all_reduce"]["bytes"] == 2 * flat, (what, kinds)
        else:
            assert kinds["reduce_scatter"]["bytes"] == flat + m["reduce_scatter"], (what, kinds)
            assert kinds["all_gather"]["bytes"] == flat + m["all_gather"], (what, kinds, m)


    gpt_case(rank, world)


def gpt_case(rank: int, world: int) -> None:
    """The planner's Muon section for L=2, H=8 is what the engine holds and moves for the
    demo GPT of that shape (its blocks' matrices under Muon) at stage 1."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=8, n_head=2, vocab=16, seq=4))
    muon = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    om = zerokern.ZeroOptimizer(muon, torch.optim.Muon, stage=1, lr=0.02)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 16, (2, 4), generator=g)
    model(x, x)[1].backward()
    om.step()
    row = estimate(float(sum(p.numel() for p in muon)), gpus=[world], layers=2, hidden=8,
                   optimizer="muon")["muon"]["rows"][0]
    assert _muon(om.memory_stats()) == row["memory_bytes"], (om.memory_stats(), row)
    kinds = om.comm_stats()["per_kind"]
    flat = om.layout.flat_numel * 4
    moved = row["bytes_per_step"]["stage1"]
    assert kinds["reduce_scatter"]["bytes"] - flat == moved["reduce_scatter"], (kinds, row)
    assert kinds["all_gather"]["bytes"] - flat == moved["all_gather"], (kinds, row)


def test_muon_exchange_memory_and_bytes_match_the_formulas(tmp_path):
    run_ranks(2, accounting_case, tmp_path=tmp_path)


def test_formulas_one_rank_and_bad_input():
    assert formulas.muon_exchange_bytes([240], 2) == {"reduce_scatter": 0, "all_gather": 0,
                                                      "total": 0, "wire": 0}
    assert formulas.muon_exchange_memory_bytes([240]) == {"muon_grad_buffer": 960,
                                                          "muon_param_buffer": 480}
    for bad in ([], [-1], [1.5]):
        try:
            formulas.muon_exchange_memory_bytes(bad)
        except ValueError as exc:
            assert "owned_numels" in str(exc)
        else:
            raise AssertionError(bad)
    try:
        formulas.muon_exchange_bytes([4, 4], 4)
    except ValueError as exc:
        assert "stage" in str(exc)
    else:
        raise AssertionError("stage 4")


def test_cli_optimizer_muon(capsys):
    assert cli.main(["--layers", "2", "--hidden", "8", "--gpus", "1", "2", "4",
                     "--optimizer", "muon"]) == 0
    text = capsys.readouterr().out
    assert "Muon owner exchange" in text and "8 hidden matrices, 1,536 parameters" in text
    assert cli.main(["--layers", "2", "--hidden", "8", "--gpus", "2", "--optimizer", "muon",
                     "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)["muon"]
    (row,) = rep["rows"]
    # 2 ranks: LPT splits the 8 matrices' NS cost evenly here, 768 elements each.
    assert row["segment_numel"] == 768 and row["padding_numel"] == 0, row
    assert row["memory_bytes"] == {"muon_grad_buffer": 2 * 768 * 4,
                                   "muon_param_buffer": 2 * 768 * 2}, row
    assert row["bytes_per_step"]["stage1"]["total"] == 2 * 768 * 6, row
    assert row["bytes_per_step"]["stage0"]["total"] == 2 * 768 * 2, row
    # Without the option, no Muon section; with it but without the shapes, a clear error.
    assert cli.main(["--params", "1e9"]) == 0
    assert "Muon" not in capsys.readouterr().out
    assert cli.main(["--params", "1e9", "--optimizer", "muon"]) == 2
    assert "--optimizer muon needs --layers and --hidden" in capsys.readouterr().err
