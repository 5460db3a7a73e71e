"""Which files of zerokern/zero/ run during one training step (backward + step + zero_grad),
world size 1, after a warm-up step: the files a reader follows line by line for that step.

    python bench/files_per_step.py 2          # stage 2, state on the device
    python bench/files_per_step.py 3 cpu      # stage 3 with offload="cpu"

Put another checkout first on PYTHONPATH to count its files (docs/how-it-works/index.md
has the before/after of issue 26).
"""
import collections
import os
import sys
import threading

import torch
import torch.nn.functional as F
from torch import nn

import zerokern


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.out(x)


stage = int(sys.argv[1])
offload = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "none" else None
torch.manual_seed(0)
model = Net().to(torch.bfloat16)
if stage == 3:
    zerokern.shard_model(model, unit_classes=(Block,))
opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, offload=offload, max_grad_norm=1.0)


def one() -> None:
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    y = torch.randint(0, 4, (8,))
    F.cross_entropy(model(x).float(), y).backward()
    opt.step()
    opt.zero_grad()


one()
root = os.path.dirname(zerokern.__file__) + "/zero/"
seen: collections.Counter[str] = collections.Counter()


def tracer(frame, event, arg):  # noqa: ANN001, ANN201
    f = frame.f_code.co_filename
    if f.startswith(root):
        seen[f[len(root):]] += 1
    return None


sys.setprofile(tracer)
threading.setprofile(tracer)
one()
sys.setprofile(None)
print(f"stage {stage} offload {offload}: {len(seen)} files:", " ".join(sorted(seen)))
