"""Stage 3 with experts idle on some ranks only (tests/test_moe_unused.py), in the training
loops where what "this backward's forwards" are is not simply the forwards since the last
backward: a forward in grad mode whose output is dropped without a backward (a metric's extra
forward, a skipped batch), and a second backward through a retained graph; and a model where
only some blocks are in a reentrant activation checkpoint (the others decide as without one).
Each rank must still decide from the graph it backwards, or the ranks reduce their units in
different orders: between units of one size, each other's gradients, without an error.
Against torch AdamW on the same model with the gradients averaged over the ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from test_moe_unused import MoE, Net
from test_zero_parity import _ref_average

import zerokern

HP = dict(lr=0.05, weight_decay=0.1)
# Per rank: the experts (block 0, block 1) the trained forward uses, and those a dropped one
# used: the dropped forward reached experts the backward's graph never had, on rank 1 only.
USED = [((0, 1, 2), (0, 1, 2)), ((0, 1, 2), (0,))]
DROPPED = [((0, 1, 2), (0, 1, 2)), ((0, 1, 2), (0, 1, 2))]


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)


def _run(rank: int, world: int, how: str, sharded: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net(reentrant=False)
    model.blocks[0].reentrant = how == "mixed"  # block 1, with the idle experts, is not
    if sharded:
        opt = zerokern.parallelize(model, stage=3, unit_classes=(MoE,), bucket_numel=40, **HP)
    else:
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **HP)
    for step in range(3):
        x, y = _batch(step, rank)
        if how == "dropped" and sharded:
            model(x, DROPPED[rank]).sum().item()  # in grad mode, dropped: no backward
        loss = F.cross_entropy(model(x, USED[rank]), y)
        if how == "retained":
            loss.backward(retain_graph=True)
            (0.5 * loss).backward()
        else:
            loss.backward()
        if not sharded:
            _ref_average(model, world)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _case(rank: int, world: int) -> None:
    for how in ("dropped", "retained", "mixed"):
        ref, got = _run(rank, world, how, False), _run(rank, world, how, True)
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5,
                                       msg=lambda m, k=k, h=how: f"{h}: {k}: {m}")


def test_dropped_forward_retained_graph_some_blocks_checkpointed_match_torch(tmp_path):
    run_ranks(2, _case, tmp_path=tmp_path)
