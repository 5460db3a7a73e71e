"""Mixture-of-experts routing against DDP(find_unused_parameters=True) + torch AdamW on two
gloo ranks: an expert that gets tokens on one rank and none on the other in a step, an expert
that gets none on any rank, at every stage. At stage 3 the units then complete their
gradients at different points on different ranks; their reduce-scatters must still be issued
in one order everywhere (a rank-dependent order aborted gloo, or, with units of one size,
swapped the gradients of two layers without a word). Also with each block's forward in a
reentrant activation checkpoint (as HF's ``gradient_checkpointing_enable()`` places it: inside
the unit's ``__call__``), which hides the experts from the forward's graph until the
recompute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint

import zerokern

E = 3


class MoE(nn.Module):
    """One attention-free block: a norm-like scale, then experts picked by a routing mask
    given per call (the mask stands in for a top-k router, so each rank can be made to skip
    chosen experts)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(6, 6)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(E))

    def forward(self, h: torch.Tensor, used: tuple[int, ...]) -> torch.Tensor:
        if self.reentrant:
            return checkpoint(self._forward, h, used, use_reentrant=True)
        return self._forward(h, used)

    def _forward(self, h: torch.Tensor, used: tuple[int, ...]) -> torch.Tensor:
        h = self.inp(h)
        return h + sum(self.experts[e](torch.tanh(h)) for e in used)


class Net(nn.Module):
    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 6)
        self.blocks = nn.ModuleList(MoE(reentrant) for _ in range(2))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, route: list[tuple[int, ...]]) -> torch.Tensor:
        h = self.emb(x)
        for b, used in zip(self.blocks, route):
            h = b(h, used)
        return self.head(h)


# Per step, per rank, the experts each block uses: (block 0, block 1).
ROUTES = [
    [((0, 1, 2), (0, 1, 2)), ((0, 1, 2), (0, 1, 2))],  # all used
    [((0, 1, 2), (0, 1, 2)), ((0, 1, 2), (0,))],  # block 1: experts 1, 2 idle on rank 1 only
    [((0, 1), (0, 2)), ((0, 1), (1, 2))],  # block 0: expert 2 idle everywhere
    [((0,), (0, 1, 2)), ((0, 1, 2), (1,))],  # both blocks, other ranks
]


def _train(rank: int, world: int, stage: int | None,
           reentrant: bool = False) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = Net(reentrant)
    if stage is None:
        net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    else:
        net = model
        opt = zerokern.parallelize(model, stage=stage, unit_classes=(MoE,), lr=0.05,
                                   weight_decay=0.1, bucket_numel=40)
    losses = []
    for step, routes in enumerate(ROUTES):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
        loss = F.cross_entropy(net(x, routes[rank]), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((loss.item(), float(norm)))
    # model.state_dict() gathers the full parameters at stage 3 (on every rank)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _case(rank: int, world: int, stages: list[int]) -> None:
    ref_losses, ref = _train(rank, world, None)
    for stage, reentrant in [(s, False) for s in stages] + [(3, True)]:
        losses, got = _train(rank, world, stage, reentrant)
        for (la, na), (lb, nb) in zip(losses, ref_losses):
            assert abs(la - lb) < 1e-5 and abs(na - nb) < 1e-5, (stage, reentrant, losses,
                                                                 ref_losses)
        for k, v in ref.items():
            assert torch.allclose(got[k], v, rtol=0, atol=1e-5), (stage, reentrant, k)


@pytest.mark.parametrize("stages", [[0, 1, 2, 3]])
def test_experts_idle_on_some_ranks_match_ddp(tmp_path, stages):
    run_ranks(2, _case, stages, tmp_path=tmp_path)
