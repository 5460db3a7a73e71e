"""Muon's optimizer step under data parallelism: zerokern's owner schedule (stages 1-3) against
every rank computing every matrix, DeepSpeed's Muon and one process, on gloo CPU ranks.

    python bench/bench_muon.py                      # the reference GPT, 2 ranks
    python bench/bench_muon.py --n-embd 128 --n-head 4 --rounds 8   # a narrower GPT
    python bench/bench_muon.py --schedules owner-s1 redundant single
    python bench/bench_muon.py --schedules owner-s2 owner-s2-sync   # overlapped vs synchronous
    python bench/bench_muon.py --quick              # tiny GPT, 1 step a round: a smoke test

The GPT is bench/gpt.py's (the reference workload of docs/how-it-works/conventions.md unless
a shape option overrides it), fp32, Muon on the blocks' 2-D weight matrices and AdamW on the
rest; muon_schedules.py defines the schedules. A schedule that does not start here
(DeepSpeed's at a stage it refuses on CPU ranks, zerokern's stage 3 with two optimizers on
one sharded model where that is refused) gets a row "skipped: <reason>". All schedules live
in one set of ranks and are timed in interleaved rounds: each round runs ``--steps`` steps of
every schedule, in the given order on even rounds and reversed on odd ones, after
``--warmup`` untimed steps each. A step's phase is the slowest rank's; a round's value the
median of its steps; a row's value the median over rounds, with the spread (min-max) and
each round's value, and each ratio is taken within a round. Communication is bytes per step
as the ZeRO paper counts them (zerokern's Muon exchange counted from the tensors its
collectives move, beside ``comm_stats()``; the redundant all-reduce from its tensors;
DeepSpeed's from the profiler over one extra step), beside zerokern.formulas.

The goal checked (issue 37): the owner schedule's Muon step at most 1/N of the redundant
schedule's Newton-Schulz time plus its own exchange, the excess within 3% of the step.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import muon_report as R  # noqa: E402
from gpt import GPTConfig, batch  # noqa: E402
from muon_schedules import CHOICES, SCHEDULES, Skip, build  # noqa: E402

from zerokern.comm.rendezvous import file_init_method  # noqa: E402

REFERENCE = dict(cfg=GPTConfig(), micro_batch=4)
QUICK = dict(cfg=GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab=64, seq=16), micro_batch=2)


@dataclass
class Job:
    """What every rank runs: picklable, handed to each spawned rank."""

    schedules: list[str]
    cfg: dict[str, Any]
    micro_batch: int
    steps: int
    warmup: int
    rounds: int
    world: int
    threads: int
    ds_ns_method: str
    init_method: str
    outdir: str


def worker(rank: int, job: Job) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job.world))
    if _wants_ds(job.schedules):
        os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is imported
    out = Path(job.outdir)
    try:
        result = run_rank(rank, job)
    except BaseException as exc:
        (out / f"rank{rank}.err").write_text(f"{type(exc).__name__}: {exc}\n"
                                             f"{traceback.format_exc()}")
        raise
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def run_rank(rank: int, job: Job) -> dict[str, Any]:
    torch.set_num_threads(job.threads)
    ds_error = None
    if _wants_ds(job.schedules):
        try:
            import deepspeed

            deepspeed.utils.logger.setLevel(logging.WARNING)
        except Exception as exc:  # not installed or broken: never a dependency
            ds_error = f"import deepspeed failed: {type(exc).__name__}: {exc}"
    dist.init_process_group("gloo", init_method=job.init_method, rank=rank,
                            world_size=job.world)
    try:
        if _wants_ds(job.schedules) and ds_error is None:
            # Finding torch's group formed, DeepSpeed adopts it.
            deepspeed.init_distributed(dist_backend="gloo")
        return train(rank, job, ds_error)
    finally:
        dist.destroy_process_group()


def _wants_ds(names: list[str]) -> bool:
    return any(n.startswith("ds-") for n in names)


def train(rank: int, job: Job, ds_error: str | None) -> dict[str, Any]:
    cfg = GPTConfig(**job.cfg)
    scheds, status = {}, {}
    for name in job.schedules:
        try:
            if name.startswith("ds-") and ds_error:
                raise Skip(ds_error)
            scheds[name] = build(name, cfg, job.world, job.micro_batch, job.ds_ns_method)
            status[name] = "ok"
        except Skip as exc:
            status[name] = f"skipped: {exc}"
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as exc:
            status[name] = f"skipped: refused: {type(exc).__name__}: {_first(exc)}"
    _agree(status, scheds)
    counter = dict.fromkeys(scheds, 1)

    def run(name: str, steps: int) -> list[dict[str, float]]:
        sch, out = scheds[name], []
        for _ in range(steps):
            s = counter[name]
            counter[name] += 1
            dist.barrier()  # every schedule's step starts on all ranks together
            if sch.ranks == "rank0" and rank != 0:
                continue
            x, y = batch(s, rank if sch.ranks == "all" else 0, job.micro_batch, cfg.seq,
                         cfg.vocab)
            r = sch.step(x, y)
            if not math.isfinite(r["loss"]):
                raise FloatingPointError(f"{name}: loss {r['loss']} at step {s}")
            out.append(r)
        return out

    for name in list(scheds):
        try:
            run(name, job.warmup)
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as exc:
            # A refusal at step() (raised on every rank before any collective of the step).
            status[name] = f"skipped: refused at step(): {type(exc).__name__}: {_first(exc)}"
            scheds.pop(name)
    _agree(status, scheds)
    rounds: dict[str, list[list[dict[str, float]]]] = {n: [] for n in scheds}
    names = list(scheds)
    for r in range(job.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rounds[name].append(run(name, job.steps))
            if rank == 0:  # progress: this rank's own times, the rows are the slowest rank's
                ms = [f"{x['step']:.0f}" for x in rounds[name][-1]]
                print(f"#   round {r + 1}, {name}: step ms on rank 0 {' '.join(ms)}",
                      flush=True)
    res: dict[str, Any] = {}
    for name in job.schedules:
        if name not in scheds:
            res[name] = {"status": status[name]}
            continue
        sch = scheds[name]
        res[name] = {"status": "ok", "what": sch.what, "ranks": sch.ranks,
                     "rounds": rounds[name], **sch.bytes()}
    for name in [n for n in scheds if n.startswith("ds-")]:
        # DeepSpeed's bytes from the profiler's collective events over one more step.
        from torch.profiler import ProfilerActivity, profile

        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            run(name, 1)
        res[name].update(H.comm_from_profile(prof, torch.device("cpu"), 1, job.world))
    return res


def _agree(status: dict[str, str], scheds: dict[str, Any]) -> None:
    """A schedule skipped on any rank is skipped on all: its collectives need every rank."""
    for other in [dict(s) for s in _gather(status)]:
        for name, st in other.items():
            if st != "ok" and status[name] == "ok":
                status[name] = st
                scheds.pop(name, None)


def _first(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:240]


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def spawn(job: Job, timeout: float) -> list[dict[str, Any]]:
    """Run the ranks; their results, or a RuntimeError with the first rank's error."""
    ctx = mp.start_processes(worker, args=(job,), nprocs=job.world, join=False,
                             start_method="spawn")
    failure = H.join_ranks(ctx, time.perf_counter(), timeout)
    out = Path(job.outdir)
    errs = sorted(out.glob("rank*.err"))
    if errs or failure:
        raise RuntimeError(f"bench_muon ranks failed ({failure}):\n"
                           + (errs[0].read_text() if errs else ""))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(job.world)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", nargs="+", choices=CHOICES, default=SCHEDULES,
                    help="default: all but the owner-s*-sync variants (the exchange "
                    "synchronous, to set beside the overlapped owner-s*)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--steps", type=int, help="timed steps per schedule and round "
                    "(default 3; --quick 2)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per schedule first")
    ap.add_argument("--micro-batch", type=int, help="sequences per rank and step (default 4; "
                    "--quick 2)")
    for k in ("n_layer", "n_embd", "n_head", "vocab", "seq"):
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, help="GPT shape override")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--ds-ns-method", default="standard", choices=["standard", "gram"],
                    help="DeepSpeed's Newton-Schulz: 'standard' (bf16, torch's math; default) "
                    "or its default 'gram' (fp16 where the CPU has it, else fp32)")
    ap.add_argument("--quick", action="store_true", help="tiny GPT, 1 step a round")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds for the whole run")
    ap.add_argument("--out", help="folder for the outputs (default bench/results)")
    ap.add_argument("--tag", default="", help="appended to the file names")
    args = ap.parse_args(argv)
    if args.world_size < 2:
        ap.error("--world-size must be at least 2 (the schedules differ only across ranks)")
    if args.rounds < 1 or (args.steps is not None and args.steps < 1):
        ap.error("--rounds and --steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = QUICK if args.quick else REFERENCE
    over = {k: getattr(args, k) for k in ("n_layer", "n_embd", "n_head", "vocab", "seq")
            if getattr(args, k) is not None}
    cfg = replace(base["cfg"], **over)
    micro = args.micro_batch or base["micro_batch"]
    steps = args.steps or (1 if args.quick else 3)
    meta = H.machine(torch.device("cpu"))
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_muon_") as tmp:
        job = Job(list(args.schedules), asdict(cfg), micro, steps, args.warmup, args.rounds,
                  args.world_size, args.threads, args.ds_ns_method, file_init_method(tmp),
                  tmp)
        ranks = spawn(job, args.timeout)
    load1 = os.getloadavg()
    command = "python bench/bench_muon.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    ctx = R.Context(cfg=cfg, world=args.world_size, micro_batch=micro, steps=steps,
                    rounds=args.rounds, threads=args.threads, meta=meta, command=command,
                    load=(load0, load1), wall_s=time.perf_counter() - t0)
    rows, round_rows = R.rows(ranks, list(args.schedules), ctx)
    lines = R.goals(rows, ctx)
    md = R.markdown(rows, lines, ctx)
    print(md)
    name = f"bench_muon_cpu_{meta['date']}" + (f"_{args.tag}" if args.tag else "")
    name += "_quick" if args.quick else ""
    path = H.write_csv([{**r, **meta} for r in rows], f"{name}.csv", args.out)
    H.write_csv(round_rows, f"{name}_rounds.csv", args.out)
    path.with_suffix(".md").write_text(md + "\n")
    print(f"# wrote {path}, {path.stem}_rounds.csv, {path.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
