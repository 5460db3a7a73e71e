"""Ranks out of step: zerokern raises a clear error on every rank where it can tell, and a
backend failure surfaces as CollectiveError naming the collective and what it moved, at
every stage."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn

import zerokern
from zerokern.comm import CollectiveError
from zerokern.zero.registry import runtime_of_module


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def different_models(rank: int, world: int, case: str) -> None:
    torch.manual_seed(0)
    width = 16 if rank == 0 or case != "shape" else 17
    blocks = 3 if rank == 0 or case != "units" else 2
    model = nn.Sequential(nn.Linear(8, width), *[Block(width) for _ in range(blocks)])
    before = [p.detach().clone() for p in model.parameters()]
    if case == "args":
        # Rank 1's arguments are refused locally; rank 0 must not wait for it in vain.
        classes = (Block,) if rank == 0 else (nn.Conv1d,)
        with pytest.raises(ValueError) as info:
            zerokern.shard_model(model, unit_classes=classes)
        want = "match no submodule" if rank == 1 else "shard_model failed on rank 1"
        assert want in str(info.value), str(info.value)
    else:
        with pytest.raises(ValueError, match="shard_model: the model differs across ranks") as info:
            zerokern.shard_model(model, unit_classes=(Block,))
        assert "build the same model on every rank" in str(info.value)
    # Nothing was modified: the parameters are the full, unchanged tensors.
    assert runtime_of_module(model) is None
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    # The group is still usable: every rank raised before any per-unit collective.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world


@pytest.mark.parametrize("case", ["shape", "units", "args"])
def test_shard_model_on_different_models_raises_on_every_rank(case, tmp_path):
    run_ranks(2, different_models, case, tmp_path=tmp_path)


def skipped_collectives(rank: int, world: int) -> None:
    # Rank 1 skips the step's collectives, first at stage 2, then at stage 3, each on a group
    # of its own with a short timeout (a timed-out group is not used again); the default
    # group stays healthy for creating the second one.
    for stage in (2, 3):
        group = dist.new_group(list(range(world)), timeout=timedelta(seconds=2))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16))
        if stage == 3:
            model = zerokern.shard_model(model, unit_classes=(Block,), process_group=group)
            opt = zerokern.ZeroAdamW(model.parameters(), lr=1e-2, stage=3)
        else:
            opt = zerokern.ZeroAdamW(model.parameters(), lr=1e-2, stage=stage,
                                     process_group=group)
        if rank == 1:
            continue  # out of step: never joins the collectives below
        with pytest.raises(CollectiveError) as info:
            loss = model(torch.randn(4, 8)).square().sum()
            loss.backward()
            opt.step()
        msg = str(info.value)
        assert f"on rank 0/{world} (gloo)" in msg, msg
        if stage == 3:
            assert "all_gather failed" in msg and "parameters of unit" in msg, msg
            # the likely cause: a forward run on one rank only
            assert "run them on every rank, not under `if rank == 0`" in msg, msg
        else:
            assert "failed" in msg and "while moving" in msg, msg


def test_collective_timeout_is_a_collective_error(tmp_path):
    run_ranks(2, skipped_collectives, tmp_path=tmp_path, isolated=True)
