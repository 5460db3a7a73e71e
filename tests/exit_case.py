"""One rank of a short ZeroAdamW training script that ends in one of the usual ways; run by
tests/exit_launch.py (the exit-stress test and scripts/stress_exit.sh). Nothing here calls
gc.collect(): that is the point.

    python tests/exit_case.py STAGE MODE RANK WORLD INIT_FILE

MODE:
  destroy    train inside a function (objects die on return), then destroy_process_group()
  nodestroy  the same without destroy_process_group()
  alive      model and optimizer at module level, still alive at exit, after destroy
  exception  module level; a step raises, the script catches it and exits without destroy
  nostep     module level; the last backward is never followed by a step (its gradient
             collectives' handles are alive, completed, never waited on), then destroy
  evalrank0  (stage 3; ends in an error on purpose) nanoGPT's evaluation under
             `if rank == 0` after a step, with a 2 s gather timeout: rank 0 is told in a
             gather the other rank never starts, both exit with status 1 (not a hang)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import zerokern

stage, mode, rank, world, init_file = sys.argv[1], sys.argv[2], *sys.argv[3:6]
stage, rank, world = int(stage), int(rank), int(world)
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) + x


def build() -> tuple[nn.Module, zerokern.ZeroAdamW]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), Block(48), Block(48), nn.Linear(48, 5))
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(Block,),
                                     gather_timeout=2.0 if mode == "evalrank0" else None)
    opt = zerokern.ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_numel=1024,
                             max_grad_norm=1.0)
    return model, opt


def train(model: nn.Module, opt: zerokern.ZeroAdamW, steps: int = 3, fail_at: int = -1) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 24, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        if step == fail_at:
            raise RuntimeError("simulated failure in the training loop")
        opt.step()  # the last collective before exit (stages 1-2: the parameter all-gather)
        opt.zero_grad(set_to_none=True)


def in_function() -> None:
    model, opt = build()
    train(model, opt)


if mode in ("destroy", "nodestroy"):
    in_function()
    if mode == "destroy":
        dist.destroy_process_group()
elif mode == "alive":
    MODEL, OPT = build()
    train(MODEL, OPT)
    dist.destroy_process_group()
elif mode == "exception":
    MODEL, OPT = build()
    try:
        train(MODEL, OPT, steps=3, fail_at=2)
    except RuntimeError as exc:
        print(f"rank {rank}: caught: {exc}")
elif mode == "nostep":
    MODEL, OPT = build()
    train(MODEL, OPT, steps=2)
    MODEL(torch.randn(8, 24)).square().mean().backward()
    dist.destroy_process_group()
elif mode == "evalrank0":
    MODEL, OPT = build()
    train(MODEL, OPT, steps=1)
    if rank == 0:
        MODEL.eval()
        with torch.no_grad():
            MODEL(torch.randn(8, 24))
        MODEL.train()
    train(MODEL, OPT, steps=2)
else:
    raise SystemExit(f"unknown mode {mode!r}")
