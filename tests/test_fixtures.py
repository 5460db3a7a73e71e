"""A checkpoint and an ``opt.state_dict()`` written by the engine before the per-stage
redesign (tests/fixtures/pre_engine, made by tests/make_fixtures.py at commit 01df1f3) load
with today's code and continue training bit for bit as they did then."""

from __future__ import annotations

from pathlib import Path

import torch
from dist_utils import run_ranks
from make_fixtures import build, train

import zerokern

FIX = Path(__file__).parent / "fixtures" / "pre_engine"


def _assert_params_equal(model: torch.nn.Module, want_path: Path) -> None:
    want = torch.load(want_path, weights_only=True)
    got = dict(model.named_parameters())
    assert set(got) == set(want)
    for n, p in got.items():
        assert torch.equal(p.detach(), want[n]), n


def _continue_checkpoint(rank: int, world: int) -> None:
    model, opt = build(2)
    extra = zerokern.load_checkpoint(FIX / "ck_stage2_world2", model, opt)
    assert extra == {"step": 3}
    train(model, opt, rank, range(3, 5))
    _assert_params_equal(model, FIX / "ck_stage2_world2_after5.pt")


def test_old_checkpoint_continues_bitwise(tmp_path):
    run_ranks(2, _continue_checkpoint, tmp_path=tmp_path)


def test_old_state_dict_continues_bitwise():
    saved = torch.load(FIX / "state_dict_stage1_world1.pt", weights_only=False)
    model, opt = build(1)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    train(model, opt, 0, range(3, 5))
    _assert_params_equal(model, FIX / "state_dict_stage1_world1_after5.pt")
