"""End-to-end training step: zerokern ZeRO stages vs DDP, ZeroRedundancyOptimizer, FSDP2 and
DeepSpeed, side by side in one run on the same GPT, data, global batch, precision and device.

    python bench/bench_zero.py                          # reference workload (DESIGN.md §7)
    python bench/bench_zero.py --precision bf16 --policies ddp zk_stage2
    python bench/bench_zero.py --quick                  # tiny model, 4 steps: a smoke test

bench/README.md describes the workload, each policy and what each column measures. This file
is the command line and the output; the policies are in zero_policies.py, the ranks that run
them in zero_ranks.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
from gpt import GPTConfig  # noqa: E402
from zero_policies import OFFLOAD_POLICIES, POLICIES, Job, unavailable  # noqa: E402
from zero_ranks import run_policy  # noqa: E402

from zerokern.comm.rendezvous import file_init_method  # noqa: E402

REFERENCE = dict(
    cfg=GPTConfig(n_layer=6, n_embd=384, n_head=6, vocab=4096, seq=128), micro_batch=4, steps=30
)
QUICK = dict(
    cfg=GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab=256, seq=32), micro_batch=2, steps=4
)


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    cols = [
        ("policy", "policy"),
        ("status", "status"),
        ("steps_s", "steps/s"),
        ("step_ms", "step ms (median)"),
        ("x_time_vs_ddp", "time / ddp"),
        ("state_mb", "model state MB/rank"),
        ("x_mem_vs_ddp", "mem / ddp"),
        ("comm_mb", "comm MB/step"),
        ("comm_ms", "comm ms/step"),
        ("loss", "final loss"),
    ]
    lines = [
        header,
        "",
        "| " + " | ".join(c[1] for c in cols) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|",
    ]
    for r in rows:
        cells = []
        for k, _ in cols:
            v = r.get(k, "")
            if k == "step_ms" and v != "":
                v = f"{v:.0f} ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f})"
            elif isinstance(v, float):
                v = (
                    f"{v:.3f}"
                    if k in ("steps_s", "x_time_vs_ddp", "x_mem_vs_ddp", "loss")
                    else f"{v:.1f}"
                )
            cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, help="timed steps (default 30; --quick: 4)")
    ap.add_argument(
        "--prof-steps",
        type=int,
        default=2,
        help="extra steps under torch.profiler for comm bytes/time (0: none)",
    )
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, help="per rank (default 4; --quick: 2)")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    ap.add_argument("--policies", nargs="+", choices=POLICIES + OFFLOAD_POLICIES,
                    default=POLICIES)
    ap.add_argument("--offload", action="store_true",
                    help="add the ZeRO-Offload rows (zerokern and DeepSpeed offload, stages 2-3; "
                    "model-state columns are device bytes; bench_offload.py adds host bytes)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per policy")
    ap.add_argument("--out", help="folder for the CSV (default bench/results)")
    ap.add_argument("--bucket-numel", type=int,
                    help="zerokern stages 0-2: bucket_numel (default: ZeroAdamW's own)")
    args = ap.parse_args(argv)
    if args.offload:
        args.policies = list(args.policies) + [p for p in OFFLOAD_POLICIES
                                               if p not in args.policies]
    if torch.device(args.device).type == "cuda" and torch.cuda.device_count() < args.world_size:
        ap.error(
            f"--world-size {args.world_size} needs as many GPUs ({torch.cuda.device_count()} here)"
        )
    return args


def run_precision(
    args: argparse.Namespace, prec: str, job_args: dict[str, Any], meta: dict[str, Any]
) -> list[dict[str, Any]]:
    """One row per policy, each run on fresh ranks, then the ratios to ddp (after the
    machine metadata: the CSV's columns keep that order)."""
    rows: list[dict[str, Any]] = []
    for pol in args.policies:
        row: dict[str, Any] = {"policy": pol, "precision": prec}
        why = unavailable(pol)
        if why:
            row["status"] = f"skipped: {why}"
        else:
            # One folder per policy: its rendezvous file and its ranks' result files.
            with tempfile.TemporaryDirectory(prefix="bench_zero_") as tmp:
                job = Job(pol, prec, **job_args, init_method=file_init_method(tmp), outdir=tmp)
                row.update(run_policy(job, args.timeout))
        if row["status"] != "ok":
            print(f"# {pol} ({prec}): {row['status']}")
        rows.append({**row, **meta})
    base = next((r for r in rows if r["policy"] == "ddp" and r["status"] == "ok"), None)
    for r in rows:
        if base and r["status"] == "ok":
            r["x_time_vs_ddp"] = r["step_ms"] / base["step_ms"]
            r["x_mem_vs_ddp"] = r["state_mb"] / base["state_mb"]
    return rows


def report(rows: list[dict[str, Any]], prec: str, device: torch.device, header: str) -> None:
    """The table and the per-policy notes on stdout, then the markdown table."""
    print(f"\n## {prec}")
    cols = [
        "policy",
        "status",
        "steps_s",
        "step_ms",
        "step_ms_min",
        "step_ms_max",
        "x_time_vs_ddp",
        "state_mb",
        "x_mem_vs_ddp",
        "params_mb",
        "grads_mb",
        "optim_mb",
        "comm_mb",
        "comm_ms",
        "loss",
    ]
    cols += ["rss_mb"] if device.type == "cpu" else ["max_alloc_mb", "max_reserved_mb"]
    H.print_table([{**r, "status": r["status"][:40]} for r in rows], cols)
    for r in rows:
        if r["status"] == "ok":
            print(
                f"#   {r['policy']}: {r['optim']}; comm {r.get('comm_kinds', '')}"
                + (f"; comm_stats {r['zk_comm_mb']:.2f} MB" if "zk_comm_mb" in r else "")
            )
    print("\n" + markdown(rows, header))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ref = QUICK if args.quick else REFERENCE
    cfg: GPTConfig = ref["cfg"]
    steps = args.steps or ref["steps"]
    mb = args.micro_batch or ref["micro_batch"]
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks' setting, so machine() reports it
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop chatter
    meta = H.machine(device)
    meta.update(
        world_size=args.world_size,
        backend="nccl" if device.type == "cuda" else "gloo",
        model=f"GPT {cfg.n_layer}x{cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab}, "
        f"seq {cfg.seq}, {cfg.num_params() / 1e6:.2f}M params",
        micro_batch=mb,
        global_batch=mb * args.world_size,
        steps=steps,
    )
    job_args = dict(
        device=device.type,
        cfg=asdict(cfg),
        micro_batch=mb,
        steps=steps,
        prof_steps=args.prof_steps,
        world=args.world_size,
        bucket_numel=args.bucket_numel,
    )
    command = "python bench/bench_zero.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(
        f"# {meta['device']} | torch {meta['torch']} | {meta['date']} | {meta['model']} | "
        f"{args.world_size} ranks ({meta['backend']}), micro-batch {mb}, {steps} steps"
    )
    for prec in args.precision:
        rows = run_precision(args, prec, job_args, meta)
        header = (
            f"**{prec}**, {meta['device']}, torch {meta['torch']}, {meta['date']}: "
            f"{meta['model']}, {args.world_size} ranks over {meta['backend']}, micro-batch "
            f"{mb}/rank, median of steps 3..{steps}.  \n`{command}`"
        )
        report(rows, prec, device, header)
        name = f"bench_zero_{device.type}_{prec}_{meta['date']}{'_quick' if args.quick else ''}"
        path = H.write_csv(rows, name + ".csv", args.out)
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
