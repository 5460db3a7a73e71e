"""Convergence of zerokern's Muon + AdamW on gloo ranks against one process of torch's.

    python bench/convergence_muon.py                       # 300 steps, 2 ranks, stage 2
    python bench/convergence_muon.py --steps 50 --stage 1 --tag s1

The bench GPT (bench/gpt.py) at a small shape, fp32, Muon (lr 0.02, momentum 0.95, Nesterov)
on the blocks' 2-D weights and AdamW (lr 1e-3, betas (0.9, 0.95), weight decay 0.1) on the
rest, the same seeded weights and the same tokens (bench/gpt.py's stream) for both runs:

  zerokern  ``ZeroOptimizer(matrices, torch.optim.Muon, stage=s)`` beside
            ``ZeroOptimizer(rest, torch.optim.AdamW, stage=s)`` on N gloo ranks, rank r
            training on ``batch(step, r, micro_batch)``
  torch     one process: ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the concatenation of
            the N ranks' micro-batches (the mean loss over it is the mean of the ranks' means,
            so its gradient is the ranks' averaged gradient: the same training run)

Output: ..._curve.csv (every step's loss of both and their difference), ..._summary.md, and a
PNG of both curves and of the difference (matplotlib, when installed; --png to place it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
from gpt import GPT, GPTConfig, batch  # noqa: E402
from muon_schedules import ADAMW, MUON, muon_split  # noqa: E402

import zerokern  # noqa: E402
from zerokern.comm.rendezvous import file_init_method  # noqa: E402

SHAPE = dict(n_layer=2, n_embd=64, n_head=2, vocab=256, seq=32)


def rank_main(rank: int, world: int, init: str, out: str, args: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cfg = GPTConfig(**SHAPE)
        torch.manual_seed(0)
        model = GPT(cfg)
        muon, rest = muon_split(model)
        om = zerokern.ZeroOptimizer(muon, torch.optim.Muon, stage=args["stage"], **MUON)
        oa = zerokern.ZeroOptimizer(rest, torch.optim.AdamW, stage=args["stage"], **ADAMW)
        losses = []
        for step in range(args["steps"]):
            x, y = batch(step, rank, args["micro_batch"], cfg.seq, cfg.vocab)
            _, loss = model(x, y)
            loss.backward()
            om.step()
            oa.step()
            om.zero_grad()
            oa.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(float(t) / world)
        if rank == 0:
            Path(out, "zk.json").write_text(json.dumps(losses))
    finally:
        dist.destroy_process_group()


def torch_run(world: int, args: dict[str, Any]) -> list[float]:
    cfg = GPTConfig(**SHAPE)
    torch.manual_seed(0)
    model = GPT(cfg)
    muon, rest = muon_split(model)
    om = torch.optim.Muon(muon, **MUON)
    oa = torch.optim.AdamW(rest, **ADAMW)
    losses = []
    for step in range(args["steps"]):
        xs, ys = zip(*(batch(step, r, args["micro_batch"], cfg.seq, cfg.vocab)
                       for r in range(world)))
        _, loss = model(torch.cat(xs), torch.cat(ys))
        loss.backward()
        om.step()
        oa.step()
        om.zero_grad()
        oa.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def plot(zk: list[float], ref: list[float], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                               gridspec_kw={"height_ratios": [3, 1]})
    a.plot(ref, label="torch.optim.Muon + AdamW, one process", lw=2.5, alpha=0.6)
    a.plot(zk, label="zerokern ZeroOptimizer Muon + AdamW, gloo ranks", lw=1)
    a.set_ylabel("training loss")
    a.set_title(title, fontsize=9)
    a.legend()
    b.plot([z - r for z, r in zip(zk, ref)], color="k", lw=1)
    b.set_ylabel("zerokern - torch")
    b.set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2, choices=[0, 1, 2])
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--out", help="folder for the CSV and markdown (default bench/results)")
    ap.add_argument("--png", help="the plot's path (default: beside the CSV)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    opts = {"steps": args.steps, "stage": args.stage, "micro_batch": args.micro_batch}
    meta = H.machine(torch.device("cpu"))
    with tempfile.TemporaryDirectory(prefix="conv_muon_") as tmp:
        mp.start_processes(rank_main, args=(args.world_size, file_init_method(tmp), tmp, opts),
                           nprocs=args.world_size, start_method="spawn")
        zk = json.loads(Path(tmp, "zk.json").read_text())
    torch.set_num_threads(1)
    ref = torch_run(args.world_size, opts)
    diff = [abs(z - r) for z, r in zip(zk, ref)]
    name = f"convergence_muon_cpu_{meta['date']}" + (f"_{args.tag}" if args.tag else "")
    path = H.write_csv([{"step": i, "zerokern": z, "torch": r, "diff": z - r}
                        for i, (z, r) in enumerate(zip(zk, ref))], f"{name}_curve.csv",
                       args.out)
    tail = max(1, args.steps // 10)
    command = "python bench/convergence_muon.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    title = (f"GPT {SHAPE['n_layer']}x{SHAPE['n_embd']}, {args.world_size} gloo ranks, stage "
             f"{args.stage}, micro-batch {args.micro_batch}/rank, {args.steps} steps")
    png = Path(args.png) if args.png else path.with_name(f"{name}_curve.png")
    plotted = plot(zk, ref, png, title)
    md = [f"{meta['device']}, torch {meta['torch']}, {meta['date']}: {title}.  ",
          f"`{command}`", "",
          "| run | first loss | final loss (mean of last 10%) | mean loss |",
          "|---|---:|---:|---:|"]
    for label, v in (("zerokern Muon + AdamW", zk), ("torch Muon + AdamW, one process", ref)):
        md.append(f"| {label} | {v[0]:.4f} | {statistics.fmean(v[-tail:]):.4f} | "
                  f"{statistics.fmean(v):.4f} |")
    md += ["", f"- largest |loss difference| over the run: {max(diff):.3g} (step "
           f"{diff.index(max(diff))}); at the last step {diff[-1]:.3g}",
           f"- plot: {png if plotted else 'not written (matplotlib not installed)'}"]
    text = "\n".join(md)
    path.with_name(f"{name}_summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
