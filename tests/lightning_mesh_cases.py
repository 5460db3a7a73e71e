"""ZeroStrategy's options (issue 36 item 5), run on 4 fresh gloo ranks by
tests/test_integration_lightning.py: stage 3 on a 2x2 mesh with int8 moments, the options
given as one ZeroConfig or as keywords, against shard_model + ZeroAdamW driven by hand with
the same options."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from lightning_cases import DIM, OUT, _loader, _raises, _trainer, make_batch
from torch import nn

import zerokern
from zerokern import ZeroConfig
from zerokern.integrations.lightning import ZeroStrategy

WIDE = 64  # a 64 x 64 weight: 4,096 elements, the smallest that int8 moments compress
STEPS = 4
LR = 1e-2


class WideBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDE)
        self.fc = nn.Linear(WIDE, WIDE)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc(torch.tanh(self.ln(h)))


class MeshNet(pl.LightningModule):
    """Two stage-3 units between two root layers; ``own`` builds its ZeroAdamW with these
    keywords instead of the strategy's ``zero_adamw`` (an optimizer that lacks options the
    strategy was given is refused)."""

    def __init__(self, own: dict[str, Any] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, WIDE)
        self.blocks = nn.ModuleList([WideBlock(), WideBlock()])
        self.head = nn.Linear(WIDE, OUT)
        self.own = own
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = make_batch(self.global_rank, batch_idx)
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        if self.own is not None:
            return zerokern.ZeroAdamW(self.parameters(), lr=LR, **self.own)
        return self.trainer.strategy.zero_adamw(self.parameters(), lr=LR)


def _by_hand(rank: int, mesh: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model and batches: shard_model(mesh=) + ZeroAdamW(mesh=, moments="int8"),
    with keywords, no trainer."""
    model = MeshNet()
    zerokern.shard_model(model, mesh=mesh, unit_classes=(WideBlock,))
    opt = zerokern.ZeroAdamW(model.parameters(), lr=LR, stage=3, mesh=mesh, moments="int8")
    losses = []
    for batch_idx in range(STEPS):
        x, y = make_batch(rank, batch_idx)
        loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, zerokern.full_state_dict(model, rank0_only=False)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), f"{what}: {k}"


def stage3_mesh_int8(rank: int, world: int, *, tmp: str) -> None:
    """ZeroStrategy(stage 3, mesh (2, 2), moments="int8") trains STEPS steps to the same
    bits as shard_model + ZeroAdamW by hand, with the options given as one ZeroConfig and as
    keywords; what would drop an option is refused."""
    cfg = ZeroConfig(stage=3, moments="int8", unit_classes=(WideBlock,))
    runs = {}
    for how, strategy in (
        ("config", ZeroStrategy(config=cfg, mesh=(2, 2))),
        ("keywords", ZeroStrategy(stage=3, unit_classes=(WideBlock,), moments="int8",
                                  mesh=(2, 2))),
    ):
        assert strategy.config == cfg, how
        model = MeshNet()
        # manual=True: _trainer without accumulation and clipping (the optimization itself
        # is Lightning's automatic one)
        tr = _trainer(rank, world, strategy, None, max_steps=STEPS, manual=True)
        tr.fit(model, _loader(world))
        assert tr.global_step == STEPS
        opt = tr.strategy.optimizers[0]
        assert opt.config == cfg and opt.state_format.moments == "int8"
        assert (opt.comm.world_size, opt.comm.replicate.world_size) == (2, 2)
        assert opt.memory_stats()["exp_avg_absmax"] > 0, "no int8 blocks on this rank"
        runs[how] = (model.losses, strategy.full_state_dict(rank0_only=False), strategy.mesh)

    losses, params = _by_hand(rank, runs["config"][2])
    for how, (got_losses, got_params, _) in runs.items():
        assert got_losses == losses, (how, got_losses, losses)
        _same_bits(got_params, params, f"ZeroStrategy({how}) vs shard_model + ZeroAdamW")

    # An optimizer of configure_optimizers without the strategy's moments, or over no mesh,
    # is refused at setup (it would train without them), before any step.
    _raises(lambda: _trainer(rank, world, ZeroStrategy(config=cfg, mesh=(2, 2)), None,
                             max_steps=1, manual=True).fit(MeshNet(own=dict(stage=3)),
                                                           _loader(world)),
            ValueError, "moments='int8' was given, but the ZeroAdamW of configure_optimizers")
    _raises(lambda: _trainer(rank, world, ZeroStrategy(stage=2, mesh=(2, 2)), None,
                             max_steps=1, manual=True).fit(MeshNet(own=dict(stage=2)),
                                                           _loader(world)),
            ValueError, "mesh [[0, 1], [2, 3]] was given, but the ZeroAdamW")


def run(rank: int, world: int, *, tmp: str, results: str) -> None:
    """The case, leaving ``<results>/mesh.rank<r>.ok`` or ``.err`` (its traceback)."""
    torch.set_num_threads(1)
    out = Path(results)
    try:
        stage3_mesh_int8(rank, world, tmp=tmp)
    except BaseException:
        (out / f"mesh.rank{rank}.err").write_text(traceback.format_exc())
        raise
    (out / f"mesh.rank{rank}.ok").write_text("")
