"""ZeRO-Offload: step time and device/host memory of zerokern stages 2 and 3 with and without
``offload="cpu"`` (stage 3 also with ``offload_params=True``; zerokern's rows are built by
``zerokern.parallelize`` in zero_policies.py), side by side with
DeepSpeed's ZeRO-Offload when it is installed (optional provider: skipped otherwise), on the
same GPT, data, batch, precision and device as bench_zero.py.

    python bench/bench_offload.py                    # reference GPT, 2 CPU ranks, bf16, 2 repeats
    python bench/bench_offload.py --quick            # tiny model: a smoke test
    python bench/bench_offload.py --device cuda --world-size 1 --fit-budget-gb 8
    python bench/bench_offload.py --precision fp32 --host-step   # the host step alone (issue 39)

Repeats are interleaved (every policy once, then every policy again) so that a drift of the
machine hits all policies alike; each row is one policy in one repeat, and the summary takes
the median over repeats. On CPU ranks the "device" is the host as well: what is measured is
the cost of the offload path itself (the same kernel, plus the copies through the staging
slots) against no offload. On a GPU, ``--fit-budget-gb`` also searches the largest model (in
layers) whose training step fits that much device memory, with and without offload.

Every offload row also times the optimizer's host step alone, inside the same training run
(host_step.py says what is timed on each side), by the updating thread's CPU time and by the
wall clock: its median per training step, the shard it updates (elements per rank), ns per
element, and for zerokern's rows the ratio to DeepSpeed's ``DeepSpeedCPUAdam`` at the same
stage (DeepSpeed's ns per element over zerokern's: > 1 means zerokern's step is faster).
``--host-step`` runs only the rows that table compares: zerokern's stage 2 with fp32, bf16 and
int8 (format versions 2 and 3) moments, fp32 master, and with fp32 moments and synchronous
collectives (``_sync``: no gather on the rank's communication threads during the host step),
its stage 3 with fp32 moments, and DeepSpeed's offload at both stages.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
from gpt import GPTConfig  # noqa: E402
from host_step import OFFLOAD_VARIANTS  # noqa: E402
from zero_policies import Job, unavailable  # noqa: E402
from zero_ranks import run_policy, worker  # noqa: E402

from zerokern.comm.rendezvous import file_init_method  # noqa: E402

MB = 1 << 20
POLICIES = [
    "zk_stage2",
    "zk_stage2_offload",
    "zk_stage3",
    "zk_stage3_offload",
    "zk_stage3_offload_params",
    "ds_stage2",
    "ds_stage2_offload",
    "ds_stage3_offload",
]
# The host step against DeepSpeed (--host-step): fp32 state and the compressed moments
# (host_step.OFFLOAD_VARIANTS), each DeepSpeed row beside zerokern's of its stage; "_sync":
# stage 2 with no gather overlapping its host step.
HOST_STEP_POLICIES = [
    "zk_stage2_offload",
    "zk_stage2_offload_sync",
    "ds_stage2_offload",
    "zk_stage2_offload_bf16",
    "zk_stage2_offload_int8",
    "zk_stage2_offload_int8v3",
    "zk_stage3_offload",
    "ds_stage3_offload",
]
CHOICES = list(dict.fromkeys(POLICIES + HOST_STEP_POLICIES + [
    f"zk_stage{k}_offload_{f}" for k in (2, 3) for f in OFFLOAD_VARIANTS]))
CLOCKS = ("_cpu", "")  # the host step by the thread's CPU time, and by the wall clock
# What each offload row is compared with: the same stage without offload.
BASELINE = {"zk_stage2_offload": "zk_stage2", "zk_stage3_offload": "zk_stage3",
            "zk_stage3_offload_params": "zk_stage3", "ds_stage2_offload": "ds_stage2",
            "ds_stage3_offload": "ds_stage3"}
REFERENCE = dict(cfg=GPTConfig(n_layer=6, n_embd=384, n_head=6, vocab=4096, seq=128),
                 micro_batch=4, steps=30)
QUICK = dict(cfg=GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab=256, seq=32), micro_batch=2,
             steps=5)


def run_one(job_args: dict[str, Any], pol: str, prec: str, timeout: float) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": pol, "precision": prec}
    why = unavailable(pol)
    if why:
        row["status"] = f"skipped: {why}"
        return row
    with tempfile.TemporaryDirectory(prefix="bench_offload_") as tmp:
        job = Job(pol, prec, **job_args, init_method=file_init_method(tmp), outdir=tmp)
        row.update(run_policy(job, timeout))
        # Host bytes (offload's host arena) are in the ranks' results, not in combine()'s row.
        ranks = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank*.json"))]
    if row["status"] == "ok":
        row["device_mb"] = row["state_mb"]
        row["host_mb"] = max((r.get("host_bytes", 0) for r in ranks), default=0) / MB
    return row


def fits_in_budget(job_args: dict[str, Any], pol: str, prec: str, budget_gb: float,
                   timeout: float) -> bool:
    """One short run with the device capped at ``budget_gb`` (CUDA, world size 1): does the
    whole training step fit?"""
    import torch.multiprocessing as mp

    frac = budget_gb * 1e9 / torch.cuda.get_device_properties(0).total_memory
    with tempfile.TemporaryDirectory(prefix="bench_offload_fit_") as tmp:
        job = Job(pol, prec, **job_args, init_method=file_init_method(tmp), outdir=tmp)
        ctx = mp.start_processes(_capped_worker, args=(job, frac), nprocs=job.world,
                                 join=False, start_method="spawn")
        try:
            ctx.join(timeout=timeout)
        except Exception:  # noqa: BLE001 - an out-of-memory rank raises here
            pass
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
            p.join(5)
        return all((Path(tmp) / f"rank{r}.json").exists() for r in range(job.world))


def _capped_worker(rank: int, job: Job, frac: float) -> None:
    torch.cuda.set_per_process_memory_fraction(min(frac, 1.0), rank)
    worker(rank, job)


def largest_fitting(job_args: dict[str, Any], pol: str, prec: str, budget_gb: float,
                    timeout: float, max_layers: int = 256) -> int:
    """The most layers (of the reference width) whose step fits ``budget_gb``: doubling, then
    bisection. 0: not even one layer fits."""
    base = GPTConfig(**job_args["cfg"])

    def ok(layers: int) -> bool:
        args = {**job_args, "cfg": asdict(replace(base, n_layer=layers)), "steps": 3,
                "prof_steps": 0}
        return fits_in_budget(args, pol, prec, budget_gb, timeout)

    lo, hi = 0, 1
    while hi <= max_layers and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_layers + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over repeats per policy, and the ratio to the same stage without offload."""
    out = []
    for pol in dict.fromkeys(r["policy"] for r in rows):
        ok = [r for r in rows if r["policy"] == pol and r.get("status") == "ok"]
        if not ok:
            out.append({"policy": pol, "status": next(r["status"] for r in rows
                                                      if r["policy"] == pol)})
            continue
        out.append({"policy": pol, "status": "ok", "repeats": len(ok),
                    "step_ms": statistics.median(r["step_ms"] for r in ok),
                    "step_ms_runs": " / ".join(f"{r['step_ms']:.0f}" for r in ok),
                    "device_mb": ok[0]["device_mb"], "host_mb": ok[0]["host_mb"],
                    "rss_mb": max(r.get("rss_mb", 0) for r in ok), "loss": ok[-1]["loss"],
                    "optim": ok[0]["optim"]})
        if all("host_step_ms" in r for r in ok):
            host = out[-1]
            host["host_numel"] = max(r["host_numel"] for r in ok)
            for clock in CLOCKS:
                ms = statistics.median(r[f"host{clock}_step_ms"] for r in ok)
                host[f"host{clock}_step_ms"] = ms
                host[f"host{clock}_step_ms_runs"] = " / ".join(
                    f"{r[f'host{clock}_step_ms']:.2f}" for r in ok)
                host[f"host{clock}_ns_per_elt"] = ms * 1e6 / max(host["host_numel"], 1)
    by = {r["policy"]: r for r in out}
    repeats = sorted({x["repeat"] for x in rows if "repeat" in x})
    for r in out:
        base = by.get(BASELINE.get(r["policy"], ""))
        if r["status"] == "ok" and base and base["status"] == "ok":
            r["x_time_vs_no_offload"] = r["step_ms"] / base["step_ms"]
            r["x_device_mem_vs_no_offload"] = r["device_mb"] / base["device_mb"]
        ds = by.get(deepspeed_of(r["policy"]) or "")
        if "host_ns_per_elt" not in r or not ds or "host_ns_per_elt" not in ds:
            continue
        r["vs_ds"] = ds["policy"]
        for clock in CLOCKS:
            key = f"host{clock}_ns_per_elt"
            r[f"x_host{clock}_vs_ds"] = ds[key] / r[key]
            # the same ratio within each repeat (both rows ran in it, one after the other)
            per = [_ns(rows, ds["policy"], k, clock) / _ns(rows, r["policy"], k, clock)
                   for k in repeats
                   if _ns(rows, ds["policy"], k, clock) and _ns(rows, r["policy"], k, clock)]
            if per:
                r[f"x_host{clock}_vs_ds_runs"] = " / ".join(f"{x:.2f}" for x in per)
    return out


def deepspeed_of(policy: str) -> str | None:
    """The DeepSpeed offload row a zerokern offload row's host step is compared with: the
    same stage (None: not a zerokern offload row)."""
    if not policy.startswith("zk_stage") or "_offload" not in policy:
        return None
    return f"ds_stage{policy[len('zk_stage')]}_offload"


def _ns(rows: list[dict[str, Any]], policy: str, repeat: int, clock: str) -> float | None:
    """ns per element of ``policy``'s host step in repeat ``repeat`` by ``clock`` (None: no
    such run)."""
    r = next((x for x in rows if x["policy"] == policy and x.get("repeat") == repeat
              and x.get("status") == "ok" and "host_step_ms" in x), None)
    return None if r is None else r[f"host{clock}_step_ms"] * 1e6 / max(r["host_numel"], 1)


STEP_COLS = [("policy", "policy"), ("step_ms", "step ms (median)"),
             ("step_ms_runs", "runs"), ("x_time_vs_no_offload", "time / no offload"),
             ("device_mb", "device MB/rank"), ("host_mb", "host MB/rank"),
             ("x_device_mem_vs_no_offload", "device mem / no offload"), ("loss", "final loss")]
HOST_COLS = [("policy", "policy"), ("host_numel", "shard elements/rank"),
             ("host_cpu_step_ms", "CPU ms (median)"), ("host_cpu_step_ms_runs", "runs"),
             ("host_cpu_ns_per_elt", "CPU ns/element"), ("x_host_cpu_vs_ds", "x DeepSpeed"),
             ("x_host_cpu_vs_ds_runs", "each repeat"),
             ("host_step_ms", "wall ms (median)"), ("host_step_ms_runs", "runs"),
             ("host_ns_per_elt", "wall ns/element"), ("x_host_vs_ds", "x DeepSpeed (wall)"),
             ("x_host_vs_ds_runs", "each repeat"), ("step_ms", "training step ms"),
             ("optim", "optimizer")]


def markdown(summary: list[dict[str, Any]], header: str,
             cols: list[tuple[str, str]] = STEP_COLS) -> str:
    lines = [header, "", "| " + " | ".join(c[1] for c in cols) + " |",
             "|---|" + "---:|" * (len(cols) - 1)]
    for r in summary:
        if r["status"] != "ok":
            lines.append(f"| {r['policy']} | {r['status']} |" + " |" * (len(cols) - 2))
            continue
        cells = []
        for k, _ in cols:
            v = r.get(k, "")
            if isinstance(v, float):
                v = (f"{v:.3f}" if k.startswith("x_") or k == "loss"
                     else f"{v:.2f}" if k.startswith("host") and k != "host_mb"
                     else f"{v:.1f}")
            cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


HOST_HEADER = ("The optimizer's host step alone (the AdamW update of the rank's host shard, "
               "bench/host_step.py) by the updating thread's CPU time and by the wall clock, "
               "the slowest rank per step, median of steps 3.. and of the repeats; x "
               "DeepSpeed: DeepSpeed's ns/element at the same stage over this row's (> 1: "
               "faster than DeepSpeedCPUAdam).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, help="timed steps (default 30; --quick: 5)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs of every policy")
    ap.add_argument("--policies", nargs="+", choices=CHOICES,
                    help="default: every offload row and its baseline (--host-step: "
                    "the host-step rows)")
    ap.add_argument("--host-step", action="store_true",
                    help="only the offload rows whose host step the second table compares "
                    "with DeepSpeed's (fp32, bf16, int8 v2 / v3 moments)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    ap.add_argument("--fit-budget-gb", type=float,
                    help="CUDA: also find the largest model (layers) fitting this device budget")
    ap.add_argument("--fit-embd", type=int, default=1024,
                    help="width of the models --fit-budget-gb tries (heads: width / 64)")
    ap.add_argument("--fit-max-layers", type=int, default=64)
    ap.add_argument("--out", help="folder for the CSVs (default bench/results)")
    ap.add_argument("--tag", default="", help="appended to the CSV names (e.g. run1)")
    args = ap.parse_args(argv)
    policies = args.policies or (HOST_STEP_POLICIES if args.host_step else POLICIES)
    device = torch.device(args.device)
    ref = QUICK if args.quick else REFERENCE
    cfg: GPTConfig = ref["cfg"]
    steps = args.steps or ref["steps"]
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks' setting, so machine() reports it
    meta = H.machine(device)
    meta.update(world_size=args.world_size, backend="nccl" if device.type == "cuda" else "gloo",
                model=f"GPT {cfg.n_layer}x{cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab}, "
                f"seq {cfg.seq}, {cfg.num_params() / 1e6:.2f}M params",
                micro_batch=ref["micro_batch"], steps=steps)
    job_args = dict(device=device.type, cfg=asdict(cfg), micro_batch=ref["micro_batch"],
                    steps=steps, prof_steps=0, world=args.world_size)
    command = "python bench/bench_offload.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print(f"# {meta['device']} | torch {meta['torch']} | {meta['date']} | {meta['model']} | "
          f"{args.world_size} ranks ({meta['backend']}), {args.precision}, {steps} steps, "
          f"{args.repeats} interleaved repeats")
    rows = []
    for rep in range(args.repeats):
        for pol in policies:
            row = run_one(job_args, pol, args.precision, args.timeout)
            row["repeat"] = rep + 1
            print(f"#   repeat {rep + 1} {pol}: {row['status']}"
                  + (f", {row['step_ms']:.1f} ms, device {row['device_mb']:.1f} MB, host "
                     f"{row['host_mb']:.1f} MB" if row["status"] == "ok" else "")
                  + (f", host step {row['host_cpu_step_ms']:.2f} ms CPU, "
                     f"{row['host_step_ms']:.2f} ms wall on {row['host_numel']} elements"
                     if "host_step_ms" in row else ""))
            rows.append({**row, **meta})
    summary = summarize(rows)
    tag = f"_{args.tag}" if args.tag else ""
    name = f"bench_offload_{device.type}_{args.precision}_{meta['date']}{tag}"
    if args.quick:
        name += "_quick"
    csv_path = H.write_csv(rows, name + ".csv", args.out)
    print(f"# wrote {csv_path}")
    header = (f"**{args.precision}**, {meta['device']}, torch {meta['torch']}, {meta['date']}: "
              f"{meta['model']}, {args.world_size} ranks over {meta['backend']}, micro-batch "
              f"{ref['micro_batch']}/rank, median of steps 3..{steps}, median of "
              f"{args.repeats} interleaved runs.  \n`{command}`")
    text = markdown(summary, header)
    hosted = [r for r in summary if "host_step_ms" in r]
    if hosted:
        text += "\n\n" + markdown(hosted, HOST_HEADER, HOST_COLS)
    print("\n" + text)
    md = csv_path.with_suffix(".md")
    md.write_text(text + "\n")
    print(f"# wrote {md}")
    if args.fit_budget_gb is not None:
        if device.type != "cuda":
            print("# --fit-budget-gb needs --device cuda: skipped")
            return 0
        fit = []
        for pol in policies:
            if unavailable(pol):
                continue
            wide = replace(cfg, n_embd=args.fit_embd, n_head=max(1, args.fit_embd // 64))
            fit_args = {**job_args, "cfg": asdict(wide)}
            layers = largest_fitting(fit_args, pol, args.precision, args.fit_budget_gb,
                                     args.timeout, args.fit_max_layers)
            params = replace(wide, n_layer=layers).num_params() if layers else 0
            fit.append({"policy": pol, "budget_gb": args.fit_budget_gb, "layers": layers,
                        "params_m": params / 1e6, **meta})
            print(f"# fits {args.fit_budget_gb:g} GB: {pol} up to {layers} layers "
                  f"({params / 1e6:.1f}M params)")
        print(f"# wrote {H.write_csv(fit, name + '_fit.csv', args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
