"""What the p.grad guard costs per training step (zerokern/zero/grad_guard.py).

Between a synchronised backward and step(), ZeroAdamW puts a GradGuard in every trainable
parameter's .grad (torch's clipping utilities then compute the global norm or are refused),
and the step's all-reduce carries every parameter's squared gradient norm. This measures a
full step (forward, backward, step, zero_grad) of a model with many small parameters (where
per-parameter bookkeeping weighs most) with the guards as shipped, against the same
optimizer with the guard installation and the per-parameter norm pass switched off in the
benchmark only. Interleaved
repeats, one process (world size 1), on CPU or the first GPU; the ratio is the result.

    python bench/bench_grad_guard.py [--layers 96] [--width 64] [--stage 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, print_table, time_fn, write_csv  # noqa: E402

import zerokern  # noqa: E402


def build(layers: int, width: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*mods).to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--stage", type=int, default=2, choices=(0, 1, 2))
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = build(a.layers, a.width, dev)
    x = torch.randn(32, a.width, device=dev)
    runs = {}
    for name in ("guards", "no_guards"):
        model = copy.deepcopy(base)
        opt = zerokern.parallelize(model, stage=a.stage, max_grad_norm=1.0)
        if name == "no_guards":  # the benchmark's switches only: no guards, no norm pass
            n = sum(1 for _ in model.parameters())
            opt._install_guards = lambda: None
            opt._param_sq_partials = lambda n=n: torch.zeros(n, device=dev)

        def step(model=model, opt=opt) -> None:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        runs[name] = step
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.repeats):  # interleaved: drift on a shared machine hits both alike
        for name, fn in runs.items():
            times[name].append(time_fn(fn, dev, warmup=3, repeats=a.steps)["ms"])
    nparams = sum(1 for _ in base.parameters())
    ref = statistics.median(times["no_guards"])
    rows = [{**machine(dev), "stage": a.stage, "params": nparams, "policy": k,
             "ms_median": round(statistics.median(v), 3),
             "ms_rounds": " ".join(f"{t:.3f}" for t in v),
             "ratio_to_no_guards": round(statistics.median(v) / ref, 3)}
            for k, v in times.items()]
    print_table(rows, ["policy", "params", "ms_median", "ms_rounds", "ratio_to_no_guards"])
    path = write_csv(rows, f"bench_grad_guard_{dev.type}_{rows[0]['date']}.csv")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
