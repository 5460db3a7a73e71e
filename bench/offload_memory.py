"""Host memory over a long ZeRO-Offload run: the resident set size (RSS) of one process
training a small model with ``offload="cpu"`` for many steps, sampled as it goes. Nothing
the run keeps per step may accumulate: after the warm-up the RSS stays flat (issue 35:
the offload pipeline's transition log grew by a few entries per chunk every step).

    python bench/offload_memory.py                       # stages 2 and 3, 20,000 steps each
    python bench/offload_memory.py --stages 3 --steps 2000 --samples 5

World size 1, CPU, fp32; many small buckets (stage 2) or units (stage 3), so that any
per-chunk record would show. Output: one row per sample (step, RSS in MB, its growth since
the warm-up, the length of the pipeline's log), then per stage the growth from the warm-up
to the end and per 1,000 steps. ``--max-growth-mb`` turns the run into a check: exit 1 when
a stage grew by more. Not a timing: the step time is not measured.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import zerokern

MB = 1 << 20


def rss_bytes() -> int:
    """This process's resident set size, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, dim: int = 24, blocks: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.out = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def run(stage: int, steps: int, samples: int, warmup: int) -> list[dict[str, float]]:
    torch.manual_seed(0)
    model = Net()
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(Block,))
    opt = zerokern.ZeroAdamW(model.parameters(), lr=1e-3, stage=stage, offload="cpu",
                             bucket_numel=600)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 24, generator=g), torch.randint(0, 5, (8,), generator=g))
            for _ in range(16)]
    marks = sorted({warmup, steps} | {warmup + (steps - warmup) * i // samples
                                      for i in range(1, samples)})
    rows: list[dict[str, float]] = []
    base = 0
    for step in range(1, steps + 1):
        x, y = data[step % len(data)]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step in marks:
            gc.collect()
            rss = rss_bytes()
            base = base or rss
            rows.append({"stage": stage, "step": step, "rss_mb": rss / MB,
                         "growth_mb": (rss - base) / MB,
                         "log_len": len(opt._engine.pipe.log),
                         "chunks": len(opt._engine.pipe.phase)})
            r = rows[-1]
            print(f"stage {stage} step {step:>6}: rss {r['rss_mb']:8.1f} MB  growth "
                  f"{r['growth_mb']:+7.2f} MB  log {r['log_len']:>6} entries "
                  f"({r['chunks']} chunks)", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--warmup", type=int, default=None,
                    help="the step whose RSS is the baseline (default steps // 20)")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--max-growth-mb", type=float, default=None,
                    help="exit 1 when a stage's RSS grew by more than this after the warm-up")
    a = ap.parse_args()
    torch.set_num_threads(1)
    warmup = a.warmup if a.warmup is not None else max(1, a.steps // 20)
    if not 0 < warmup < a.steps:
        ap.error("--warmup must be between 0 and --steps")
    worst = 0.0
    for stage in a.stages:
        rows = run(stage, a.steps, max(a.samples, 2), warmup)
        growth = rows[-1]["growth_mb"]
        per_k = growth / (rows[-1]["step"] - rows[0]["step"]) * 1000
        print(f"stage {stage}: {growth:+.2f} MB from step {rows[0]['step']} to "
              f"{rows[-1]['step']} ({per_k:+.3f} MB per 1,000 steps)")
        worst = max(worst, growth)
    if a.max_growth_mb is not None and worst > a.max_growth_mb:
        print(f"FAIL: grew by {worst:.2f} MB > {a.max_growth_mb} MB")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
