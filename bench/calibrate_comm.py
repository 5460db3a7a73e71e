"""Calibrate the estimate's communication-time model (zerokern/comm_model.py) on this machine.

    python bench/calibrate_comm.py                      # 2 and 4 gloo ranks, stages 2 and 3
    python bench/calibrate_comm.py --tag run2           # a second run, its own files
    python bench/calibrate_comm.py --no-bench           # without bench_zero.py (faster)

1. gloo's collectives as zerokern runs them (``Comm``: all_gather -> all_gather_into_tensor,
   reduce_scatter -> the point-to-point exchange zerokern uses on gloo, all_reduce), bf16,
   over 2 and 4 CPU ranks at 4 KB - 16 MB, each size cycling through 64 MB of buffers as a
   step's calls do: the slowest rank's time, mean (what adds up over a step) and best (the
   least disturbed: the machine is shared) of the repeats.
2. A link fitted per world size to all three kinds (comm_model.fit_alpha_beta: latency per
   ring step alpha, bandwidth B, least squares on log(predicted / measured)), one pooled
   over both sizes, and per-kind fits, to show how far gloo's own algorithms are from the
   ring the model assumes.
3. bench_zero.py's step: the same ranks build its model (GPT 6x384, bf16, zero_policies.build)
   under ZeroAdamW stages 2 and 3, run two steps recording every collective call, then replay
   the second step's calls alone (same sizes, dtypes and order, one after another, no
   compute): the step's communication time, measured. Predicted: (a) the ring model with
   the link fitted at that world size on the recorded calls; (b) the estimate's plan
   (comm_model.step_collectives on the model's parameter count, one node of W ranks,
   2**21-element buckets).
4. bench_zero.py itself (a subprocess, few steps): its comm_ms (torch.profiler: the union of
   the gloo events of a step, overlap with compute and waiting for the peer included) and
   step_ms.

Mean against mean (and best against best); error = predicted / measured - 1. Writes
calibrate_comm_cpu_DATE[_TAG]_{collectives,steps}.csv and .md to bench/results (or --out).
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _harness as H  # noqa: E402
from gpt import GPTConfig, batch  # noqa: E402

from zerokern.comm.collectives import Comm  # noqa: E402
from zerokern.comm.rendezvous import file_init_method  # noqa: E402
from zerokern.comm_model import (  # noqa: E402
    KINDS,
    Cluster,
    Link,
    fit_alpha_beta,
    ring_seconds,
    step_collectives,
    step_seconds,
)

CFG = GPTConfig(n_layer=6, n_embd=384, n_head=6, vocab=4096, seq=128)  # bench_zero REFERENCE
MICRO_BATCH = 4
SIZES = [1 << e for e in range(12, 25, 2)]  # bytes: 4 KB .. 16 MB
DTYPES = {"torch.bfloat16": torch.bfloat16, "torch.float32": torch.float32,
          "torch.float64": torch.float64, "torch.int64": torch.int64}


# -- on each rank --------------------------------------------------------------------------
def _timed(comm: Comm, fn: Any, repeats: int, inner: int = 1) -> tuple[float, float]:
    """(mean, best) over ``repeats`` of the slowest rank's time of ``fn`` (after one warm-up),
    every repeat started together (a barrier) and timing ``inner`` calls back to back (small
    collectives: the barrier's skew and a rank's preemption spread over several calls).
    The mean is what adds up: a step's expected time is the sum of its calls' expected times,
    whatever the noise, where the sum of the calls' best times is below the best step. The
    best repeat is the one the machine's other load disturbed least."""
    fn()
    mine = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        mine.append((time.perf_counter() - t0) / inner)
    t = torch.tensor(mine, dtype=torch.float64)
    comm.all_reduce(t, "times", count=False, op=dist.ReduceOp.MAX)
    return statistics.fmean(t.tolist()), min(t.tolist())


def _call(comm: Comm, kind: str, numel: int, dtype: torch.dtype, copies: int = 1) -> Any:
    """A closure running one synchronous collective of ``kind`` on a full tensor of
    ``numel`` elements (all-gather output, reduce-scatter input, all-reduce tensor), on the
    next of ``copies`` buffers each time: a step's calls each touch buffers of their own, so
    a size repeated on one buffer (hot in the core's cache) would be faster than in a step."""
    w = comm.world_size
    bufs = itertools.cycle([(torch.zeros(numel, dtype=dtype), torch.zeros(numel // w,
                                                                          dtype=dtype))
                            for _ in range(copies)])

    def run() -> None:
        full, part = next(bufs)
        if kind == "all_gather":
            comm.all_gather(full, part, "calibration", count=False)
        elif kind == "reduce_scatter":
            comm.reduce_scatter(part, full, "calibration")
        else:
            comm.all_reduce(full, "calibration", count=False)
    return run


def _micro(comm: Comm, repeats: int) -> list[dict[str, Any]]:
    out = []
    for kind in KINDS:
        for nbytes in SIZES:
            # 64 MB of buffers in turn (past the 4 MB L2 here); about 1 MB a timed repeat
            fn = _call(comm, kind, nbytes // 2, torch.bfloat16,
                       copies=max(1, min(16, (64 << 20) // nbytes)))
            inner = max(1, min(16, (1 << 20) // nbytes))
            mean, best = _timed(comm, fn, repeats, inner)
            out.append({"kind": kind, "world": comm.world_size, "bytes": nbytes,
                        "seconds": mean, "seconds_best": best})
    return out


def _recording(log: list[tuple[str, int, str]]) -> dict[str, Any]:
    """Class-level wrappers of Comm's collectives that append (kind, full numel, dtype) of
    every call to ``log``; returns the originals (to restore)."""
    originals = {k: getattr(Comm, k) for k in KINDS}
    which = {"all_gather": 0, "reduce_scatter": 1, "all_reduce": 0}  # the full tensor's arg

    def wrap(kind: str) -> Any:
        f = originals[kind]

        @functools.wraps(f)
        def g(self: Comm, *a: Any, **k: Any) -> Any:
            if self.world_size > 1:
                t = a[which[kind]]
                log.append((kind, t.numel(), str(t.dtype)))
            return f(self, *a, **k)
        return g

    for k in KINDS:
        setattr(Comm, k, wrap(k))
    return originals


def _capture(rank: int, world: int, stage: int) -> list[tuple[str, int, str]]:
    """bench_zero's zk_stage<stage> (bf16) on this rank: two steps, the collectives of the
    second one."""
    from zero_policies import Job, build

    job = Job(f"zk_stage{stage}", "bf16", "cpu", asdict(CFG), MICRO_BATCH, 2, 0, world, "", "")
    log: list[tuple[str, int, str]] = []
    originals = _recording(log)
    try:
        setup = build(job, torch.device("cpu"))
        for step in (1, 2):
            del log[:]
            setup.step(*batch(step, rank, MICRO_BATCH, CFG.seq, CFG.vocab))
    finally:
        for k, f in originals.items():
            setattr(Comm, k, f)
    return list(log)


def _replay(comm: Comm, calls: list[tuple[str, int, str]],
            repeats: int) -> tuple[float, float]:
    fns = [_call(comm, kind, numel, DTYPES[dtype]) for kind, numel, dtype in calls]
    return _timed(comm, lambda: [f() for f in fns], repeats)


def rank_main(rank: int, world: int, init_method: str, opts: dict[str, Any],
              outdir: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        comm = Comm()
        res: dict[str, Any] = {"micro": _micro(comm, opts["repeats"]), "steps": {}}
        for stage in opts["stages"]:
            calls = _capture(rank, world, stage)
            mean, best = _replay(comm, calls, opts["repeats"])
            res["steps"][str(stage)] = {"calls": calls, "replay_s": mean,
                                        "replay_best_s": best}
        if rank == 0:
            (Path(outdir) / "result.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def run_world(world: int, opts: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="calibrate_comm_") as tmp:
        mp.start_processes(rank_main, args=(world, file_init_method(tmp), opts, tmp),
                           nprocs=world, start_method="spawn")
        return json.loads((Path(tmp) / "result.json").read_text())


def run_bench_zero(world: int, stages: list[int], steps: int) -> dict[int, dict[str, Any]]:
    """bench_zero.py's zk_stage rows (bf16) at ``world`` ranks: {stage: its CSV row}."""
    with tempfile.TemporaryDirectory(prefix="calibrate_bench_") as tmp:
        cmd = [sys.executable, str(HERE / "bench_zero.py"), "--device", "cpu", "--precision",
               "bf16", "--policies", *[f"zk_stage{s}" for s in stages], "--world-size",
               str(world), "--steps", str(steps), "--prof-steps", "1", "--out", tmp]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        (path,) = Path(tmp).glob("*.csv")
        with path.open() as f:
            rows = list(csv.DictReader(f))
    return {int(r["policy"][-1]): r for r in rows if r["status"] == "ok"}


# -- the driver ----------------------------------------------------------------------------
def _err(pred: float, meas: float) -> float:
    return pred / meas - 1


def _predict_calls(calls: list[tuple[str, int, str]], world: int, link: Link) -> float:
    return sum(ring_seconds(kind, numel * DTYPES[dtype].itemsize, world, link)
               for kind, numel, dtype in calls)


def _rel_rms(rows: list[dict[str, Any]], key: str) -> float:
    return math.sqrt(statistics.fmean(r[key] ** 2 for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[0, 1, 2, 3])
    ap.add_argument("--repeats", type=int, default=9, help="timed repeats per measurement")
    ap.add_argument("--bench-steps", type=int, default=3, help="bench_zero.py --steps")
    ap.add_argument("--no-bench", action="store_true", help="do not run bench_zero.py")
    ap.add_argument("--tag", default="", help="suffix of the output files (e.g. run2)")
    ap.add_argument("--out", help="folder for the CSV and MD (default bench/results)")
    args = ap.parse_args(argv)
    if any(w < 2 for w in args.worlds) or args.repeats < 1 or args.bench_steps < 3:
        ap.error("--worlds need >= 2 ranks, --repeats >= 1, --bench-steps >= 3")
    torch.set_num_threads(1)
    meta = H.machine(torch.device("cpu"))
    opts = {"repeats": args.repeats, "stages": args.stages}
    t_start = time.perf_counter()

    results = {}
    for w in args.worlds:
        results[w] = run_world(w, opts)
        print(f"# {w} ranks: collectives and steps done at {time.perf_counter() - t_start:.0f} s",
              file=sys.stderr)
    micro = [m for w in args.worlds for m in results[w]["micro"]]

    def fit(pts: list[dict[str, Any]], key: str = "seconds") -> Link:
        return fit_alpha_beta([(m["kind"], m["world"], m["bytes"], m[key]) for m in pts])

    pooled = fit(micro)  # one link for every kind and world size
    links = {w: fit([m for m in micro if m["world"] == w]) for w in args.worlds}
    # The same from the best repeats (the machine's other load at its least).
    links_best = {w: fit([m for m in micro if m["world"] == w], "seconds_best")
                  for w in args.worlds}
    per_kind = {(k, w): fit([m for m in micro if m["kind"] == k and m["world"] == w])
                for k in KINDS for w in args.worlds}
    for m in micro:
        m["predicted_s"] = ring_seconds(m["kind"], m["bytes"], m["world"], links[m["world"]])
        m["error"] = _err(m["predicted_s"], m["seconds"])
        m["predicted_pooled_s"] = ring_seconds(m["kind"], m["bytes"], m["world"], pooled)
        m["error_pooled"] = _err(m["predicted_pooled_s"], m["seconds"])

    bench = {}
    if not args.no_bench:
        for w in args.worlds:
            bench[w] = run_bench_zero(w, args.stages, args.bench_steps)
            print(f"# {w} ranks: bench_zero.py done at {time.perf_counter() - t_start:.0f} s",
                  file=sys.stderr)
    steps = []
    for w in args.worlds:
        link = links[w]
        for stage in args.stages:
            rec = results[w]["steps"][str(stage)]
            calls = [tuple(c) for c in rec["calls"]]
            plan = step_collectives(stage, CFG.num_params(), Cluster(1, w, link, link),
                                    hybrid=False)
            row: dict[str, Any] = {
                "world": w, "stage": stage, "calls": len(calls),
                "comm_mb": sum(n * DTYPES[d].itemsize for _, n, d in calls) / 2**20,
                "alpha_us": link.latency_s * 1e6, "bandwidth_gb_s": link.bandwidth_gb_s,
                "predicted_calls_ms": 1e3 * _predict_calls(calls, w, link),
                "predicted_plan_ms": 1e3 * step_seconds(plan, Cluster(1, w, link, link))["total"],
                "predicted_pooled_ms": 1e3 * _predict_calls(calls, w, pooled),
                "replay_ms": 1e3 * rec["replay_s"],
                "predicted_best_ms": 1e3 * _predict_calls(calls, w, links_best[w]),
                "replay_best_ms": 1e3 * rec["replay_best_s"],
            }
            row["error_calls_vs_replay"] = _err(row["predicted_calls_ms"], row["replay_ms"])
            row["error_plan_vs_replay"] = _err(row["predicted_plan_ms"], row["replay_ms"])
            row["error_pooled_vs_replay"] = _err(row["predicted_pooled_ms"], row["replay_ms"])
            row["error_best_vs_replay_best"] = _err(row["predicted_best_ms"],
                                                    row["replay_best_ms"])
            b = bench.get(w, {}).get(stage)
            if b:
                row["bench_comm_ms"] = float(b["comm_ms"])
                row["bench_step_ms"] = float(b["step_ms"])
                row["error_calls_vs_bench_comm"] = _err(row["predicted_calls_ms"],
                                                         row["bench_comm_ms"])
            steps.append({**row, **meta})

    tag = f"_{args.tag}" if args.tag else ""
    name = f"calibrate_comm_cpu_{meta['date']}{tag}"
    H.write_csv([{**m, **meta} for m in micro], name + "_collectives.csv", args.out)
    path = H.write_csv(steps, name + "_steps.csv", args.out)
    md = report(meta, pooled, links, links_best, per_kind, micro, steps, args,
                time.perf_counter() - t_start)
    (path.parent / (name + ".md")).write_text(md + "\n")
    print(md)
    print(f"# wrote {path.parent / name}{{_collectives.csv,_steps.csv,.md}}")
    return 0


def _med_abs(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(abs(r[key]) for r in rows)


def report(meta: dict[str, Any], pooled: Link, links: dict[int, Link],
           links_best: dict[int, Link], per_kind: dict[tuple[str, int], Link],
           micro: list[dict[str, Any]], steps: list[dict[str, Any]],
           args: argparse.Namespace, seconds: float) -> str:
    """The markdown summary: the fits, each collective against them, each step's
    prediction against its replay and bench_zero.py."""
    import zerokern

    cmd = "python bench/calibrate_comm.py " + " ".join(sys.argv[1:])
    lines = [
        f"# Communication-time model calibration: {meta['device']}, torch {meta['torch']}, "
        f"{meta['date']}",
        "",
        f"`{cmd.strip()}` ({seconds:.0f} s; gloo on CPU ranks of 1 thread each, a shared "
        f"machine; zerokern from {Path(zerokern.__file__).parent}). Model: "
        "zerokern/comm_model.py; method: bench/calibrate_comm.py. error = predicted / "
        "measured - 1; a time is the slowest rank's, mean of the repeats (what adds up over a "
        "step's calls); the best repeats (the machine's other load at its least) give the "
        "(best) fits.",
        "",
        "**Fitted links** (least squares on log(predicted / measured), all three kinds at "
        f"{len(SIZES)} sizes):",
        "",
        "| fit | points | alpha us per ring step | B GB/s | median abs error | RMS error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for w, lk in links.items():
        pts = [m for m in micro if m["world"] == w]
        lines.append(f"| {w} ranks | {len(pts)} | {lk.latency_s * 1e6:.1f} | "
                     f"{lk.bandwidth_gb_s:.3f} | {_med_abs(pts, 'error'):.0%} | "
                     f"{_rel_rms(pts, 'error'):.0%} |")
    lines.append(f"| pooled {args.worlds} | {len(micro)} | {pooled.latency_s * 1e6:.1f} | "
                 f"{pooled.bandwidth_gb_s:.3f} | {_med_abs(micro, 'error_pooled'):.0%} | "
                 f"{_rel_rms(micro, 'error_pooled'):.0%} |")
    for w, lk in links_best.items():
        lines.append(f"| {w} ranks (best) | {len(micro) // len(links)} | "
                     f"{lk.latency_s * 1e6:.1f} | {lk.bandwidth_gb_s:.3f} | | |")
    lines += ["", "Per kind and world (gloo's own algorithms; zerokern's reduce-scatter is a "
              "point-to-point exchange on gloo), for comparison:", "",
              "| kind | world | alpha us | B GB/s |", "|---|---:|---:|---:|"]
    for (kind, w), lk in per_kind.items():
        lines.append(f"| {kind} | {w} | {lk.latency_s * 1e6:.1f} | {lk.bandwidth_gb_s:.3f} |")
    lines += ["", "Collectives, measured vs the link fitted at their world size (and pooled):",
              "", "| kind | world | bytes | measured ms | predicted ms | error | pooled error |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for m in micro:
        lines.append(f"| {m['kind']} | {m['world']} | {m['bytes']} | {m['seconds'] * 1e3:.3f} "
                     f"| {m['predicted_s'] * 1e3:.3f} | {m['error']:+.0%} | "
                     f"{m['error_pooled']:+.0%} |")
    lines += ["", "bench_zero.py's step (GPT 6x384, 13.84M params, bf16, micro-batch 4), "
              "communication per step. calls: the collectives of one step, scalar all-reduces "
              "included; predicted (calls): the ring model on those calls with the link fitted "
              "at that world size; (plan): the estimate's plan (comm_model.step_collectives) "
              "for 13.84M parameters; (pooled): the calls with the pooled link; replay: the "
              "calls alone, one after another (measured); (best): the best replay against "
              "the best fit; bench comm: bench_zero.py's profiler figure (overlap with "
              "compute and waiting included).", "",
              "| world | stage | calls | MB | predicted (calls) ms | (plan) ms | (pooled) ms | "
              "replay ms | error | plan error | pooled error | (best) pred / replay ms | "
              "(best) error | bench comm ms | error vs bench | bench step ms |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
              "---:|"]
    for r in steps:
        bench = (f"{r['bench_comm_ms']:.1f} | {r['error_calls_vs_bench_comm']:+.0%} | "
                 f"{r['bench_step_ms']:.0f}" if "bench_comm_ms" in r else "- | - | -")
        lines.append(
            f"| {r['world']} | {r['stage']} | {r['calls']} | {r['comm_mb']:.1f} | "
            f"{r['predicted_calls_ms']:.1f} | {r['predicted_plan_ms']:.1f} | "
            f"{r['predicted_pooled_ms']:.1f} | {r['replay_ms']:.1f} | "
            f"{r['error_calls_vs_replay']:+.0%} | {r['error_plan_vs_replay']:+.0%} | "
            f"{r['error_pooled_vs_replay']:+.0%} | {r['predicted_best_ms']:.1f} / "
            f"{r['replay_best_ms']:.1f} | {r['error_best_vs_replay_best']:+.0%} | "
            f"{bench} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
