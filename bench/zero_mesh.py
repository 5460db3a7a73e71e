"""bench_zero.py --mesh RxS (issue 28): flat against hybrid sharding, side by side in one run.

R*S ranks form one 2-D DeviceMesh (dim 0 replicates, dim 1 shards: FSDP2's convention and
zerokern's, docs/hybrid.md). The policies (zero_policies.MESH_POLICIES): ddp; FSDP2 flat
(``fully_shard`` over all ranks) and HSDP (``fully_shard(mesh=mesh)``); zerokern stages 1-3
flat (``parallelize`` over all ranks) and hybrid (``parallelize(mesh=mesh)``).

Why one set of ranks for every policy, unlike bench_zero.py's other modes (fresh processes per
policy): on the 2-core VMs, starting 4 ranks that import torch costs about 40 s, more than
all the training steps of a policy, and 9 policies x 2 rounds of it would take 12 minutes.
Here the ranks start once, and every policy runs in turn on a fresh seeded model and
optimizer (the previous one freed first) in the same process group, ``rounds`` times, the
order reversed every other round; each ratio is taken within a round. What this shares
between policies: the process, its allocator and its peak resident set (so no rss column),
and the process groups the mesh made. Model-state bytes are counted from each policy's own
objects and are unaffected.

Traffic per mesh dim, per rank and step: zerokern's from ``comm_stats()["per_dim"]`` of the
last timed step; FSDP2's from its collectives, recorded during one extra step by wrapping the
``torch.distributed`` functions it calls (``all_gather_single``, ``reduce_scatter_single``,
``all_reduce``, and the ``_into_tensor`` / ``_tensor`` forms): each call is given to the mesh
dim whose process group it ran on, counted as the paper counts (an all-gather its output, a
reduce-scatter its input, an all-reduce twice its tensor) and on the wire ((n-1)/n of that).
A flat run's group is the "shard" dim, as in ``comm_stats``. DDP's all-reduce runs inside its
C++ reducer, out of reach of that wrapper: its traffic is not measured here (the default
bench_zero.py run measures it with the profiler: 2 Psi over the flat group).

"inter-node MB": what one inter-node link would carry per step if dim 0 were the nodes
(``zerokern.comm_model.link_traffic``'s convention): a flat ring crosses the node boundary,
so each of its hops, inter-node ones included, carries what a rank sends on the flat group;
hybrid sends only the replicate dim across. The CPU has no slow link: that column and the
time model's predictions (``predictions``) are what a cluster would see, not what was timed.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness as H
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpt import GPTConfig, batch
from zero_policies import FLAT_OF, HPZ_OF, HYBRID_OF, Job, Skip, build
from zero_ranks import combine, train

from zerokern.comm_model import Cluster, Link, step_collectives, step_seconds

DIMS = ("shard", "replicate")

# The time model's link fitted on this machine's gloo at 4 ranks (bench/calibrate_comm.py,
# bench/results/calibrate_comm_cpu_2026-12-02_run{1,2}.md, mean of the repeats): one link,
# used as both "intra" and "inter", since every rank here talks over the same loopback.
CALIBRATED = {
    "gloo 4 ranks, calibration run 1": Link(0.166, 1814.5e-6),
    "gloo 4 ranks, calibration run 2": Link(0.231, 1860.6e-6),
}
# Typical GPU links (zerokern.comm_model's defaults): NVLink-class inside a node, one
# 200 Gb/s NIC per GPU across nodes.
GPU_LINKS = (Link(200.0, 2e-6), Link(25.0, 5e-6))


def parse_mesh(spec: str) -> tuple[int, int]:
    """'RxS' -> (R, S): R replicas (dim 0) of S ranks (dim 1), both at least 1, R*S >= 2."""
    r, sep, s = spec.lower().partition("x")
    if not sep or not r.isdigit() or not s.isdigit() or int(r) < 1 or int(s) < 1:
        raise ValueError(f"--mesh wants RxS with positive integers (e.g. 2x2), got {spec!r}")
    if int(r) * int(s) < 2:
        raise ValueError(f"--mesh {spec}: needs at least 2 ranks")
    return int(r), int(s)


@dataclass
class MeshJob:
    """What the ranks of a --mesh run do: picklable, handed to every spawned rank."""

    policies: list[str]
    precision: str
    device: str
    cfg: dict[str, Any]
    micro_batch: int
    steps: int
    rounds: int
    shape: tuple[int, int]  # (R replicas, S ranks per shard group)
    init_method: str
    outdir: str
    bucket_numel: int | None = None

    @property
    def world(self) -> int:
        return self.shape[0] * self.shape[1]


# -- FSDP2's collectives per mesh dim ---------------------------------------------------------
# name -> (the argument holding the full tensor, paper factor)
_RECORDED = {
    "all_gather_single": ("output_tensor", 1),
    "all_gather_into_tensor": ("output_tensor", 1),
    "reduce_scatter_single": ("input", 1),
    "reduce_scatter_tensor": ("input", 1),
    "all_reduce": ("tensor", 2),
}


@contextmanager
def recording(groups: dict[str, list[int]]) -> Iterator[dict[str, float]]:
    """While inside, every call of the ``torch.distributed`` functions in _RECORDED adds its
    bytes to the dim (``groups``: dim -> the ranks of this rank's group on it) whose ranks
    it ran on: ``<dim>_bytes``, ``<dim>_elements`` (paper count), ``<dim>_wire_bytes`` and
    ``<dim>_calls``;
    a group on no dim goes to "other". Calls made from inside a recorded call count once."""
    out: dict[str, float] = {}
    saved = {name: getattr(dist, name) for name in _RECORDED}
    depth = [0]

    def wrap(name: str, fn: Any) -> Any:
        sig = inspect.signature(fn)
        arg, factor = _RECORDED[name]

        def recorded(*a: Any, **k: Any) -> Any:
            if depth[0] == 0:
                b = sig.bind(*a, **k).arguments
                t = b[arg]
                group = b.get("group")
                ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None
                                                     else group)
                dim = next((d for d, r in groups.items() if sorted(r) == sorted(ranks)), "other")
                n = len(ranks)
                for key, v in (("elements", factor * t.numel()),
                               ("bytes", factor * t.numel() * t.element_size())):
                    out[f"{dim}_{key}"] = out.get(f"{dim}_{key}", 0) + v
                out[f"{dim}_wire_bytes"] = (out.get(f"{dim}_wire_bytes", 0)
                                            + factor * t.numel() * t.element_size() * (n - 1) / n)
                out[f"{dim}_calls"] = out.get(f"{dim}_calls", 0) + 1
            depth[0] += 1
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1

        return recorded

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield out
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


# -- one rank ---------------------------------------------------------------------------------
def mesh_worker(rank: int, job: MeshJob) -> None:
    """Form the group and the mesh, then every policy of every round in turn; one JSON per
    (round, policy) in job.outdir: the rank's result or its error."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job.world))
    cuda = job.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=job.init_method, rank=rank,
                            world_size=job.world, device_id=device if cuda else None)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        mesh = init_device_mesh(device.type, job.shape, mesh_dim_names=("replicate", "shard"))
        groups = {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in DIMS}
        flat = {"shard": list(range(job.world)), "replicate": [rank]}
        out = Path(job.outdir)
        for rnd in range(1, job.rounds + 1):
            for pol in job.policies if rnd % 2 else job.policies[::-1]:
                res = _run_one(rank, job, pol, device, mesh, groups if pol in HYBRID_OF else flat)
                (out / f"r{rnd}_{pol}_rank{rank}.json").write_text(json.dumps(res))
                dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_one(rank: int, job: MeshJob, pol: str, device: torch.device, mesh: Any,
             groups: dict[str, list[int]]) -> dict[str, Any]:
    pjob = Job(pol, job.precision, job.device, job.cfg, job.micro_batch, job.steps,
               prof_steps=0, world=job.world, init_method=job.init_method, outdir=job.outdir,
               bucket_numel=job.bucket_numel)
    setup = None
    try:
        setup = build(pjob, device, mesh)
        res = train(rank, pjob, device, setup)
        if setup.comm_dims is not None:  # zerokern: its own count of the last timed step
            res["dims"] = setup.comm_dims()
        elif pol.startswith("fsdp2"):  # one more step, its collectives recorded
            cfg = GPTConfig(**job.cfg)
            x, y = batch(job.steps + 1, rank, job.micro_batch, cfg.seq, cfg.vocab, device)
            with recording(groups) as rec:
                setup.step(x, y)
            res["dims"] = dict(rec)
        return res
    except Exception as exc:  # every rank fails alike (a refusal): the row says why
        print(f"# {pol} on rank {rank}:\n{traceback.format_exc()}", file=sys.stderr)
        kind = "skipped" if isinstance(exc, Skip) else "error"
        return {"status": f"{kind}: {type(exc).__name__}: {exc}".splitlines()[0][:300]}
    finally:
        del setup
        gc.collect()


# -- driver -----------------------------------------------------------------------------------
def run_mesh(job: MeshJob, timeout: float) -> list[dict[str, Any]]:
    """Spawn the ranks once, wait (at most ``timeout`` s for everything), one row per round
    and policy (rows of a round that did not finish: their error)."""
    t0 = time.perf_counter()
    ctx = mp.start_processes(mesh_worker, args=(job,), nprocs=job.world, join=False,
                             start_method=H.rank_start_method())
    failure = H.join_ranks(ctx, t0, timeout)
    failure = None if failure is None else f"error: {failure}"
    out = Path(job.outdir)
    rows = []
    for rnd in range(1, job.rounds + 1):
        for pol in job.policies:
            row: dict[str, Any] = {"policy": pol, "round": rnd,
                                   "layout": _layout(pol, job.shape)}
            files = [out / f"r{rnd}_{pol}_rank{r}.json" for r in range(job.world)]
            ranks = [json.loads(f.read_text()) for f in files if f.exists()]
            bad = next((r["status"] for r in ranks if "status" in r), None)
            if bad or len(ranks) != job.world:
                row["status"] = bad or failure or "error: a rank wrote no result"
            else:
                row.update(combine(ranks, job.steps))
                row.pop("rss_mb", None)  # the process's peak over every policy so far
                dims = ranks[0].get("dims", {})
                # hpZ's comm_stats has a "world" dim too: its forward gathers and reduces
                for d in (*DIMS, "world") if pol in HPZ_OF else DIMS:
                    if dims:
                        row[f"{d}_mb"] = dims.get(f"{d}_bytes", 0) / H.MB
                        row[f"{d}_wire_mb"] = dims.get(f"{d}_wire_bytes", 0) / H.MB
                        row[f"{d}_calls"] = dims.get(f"{d}_calls", 0)
                if dims.get("other_bytes"):
                    row["other_mb"] = dims["other_bytes"] / H.MB
                if dims and job.shape[0] > 1:  # what one inter-node link carries
                    row["inter_mb"] = row["replicate_wire_mb" if pol in HYBRID_OF
                                          else "world_wire_mb" if pol in HPZ_OF
                                          else "shard_wire_mb"]
            rows.append(row)
    return rows


def _layout(pol: str, shape: tuple[int, int]) -> str:
    r, s = shape
    return (f"hybrid {r}x{s}" if pol in HYBRID_OF else f"hpZ {r}x{s}" if pol in HPZ_OF
            else f"flat {r * s}")


def add_round_ratios(rows: list[dict[str, Any]]) -> None:
    """Within each round: step time over ddp's and, for a hybrid row, over its flat
    policy's (zero_policies.FLAT_OF: a hybrid or hpZ row's flat policy)."""
    ok = {(r["round"], r["policy"]): r for r in rows if r["status"] == "ok"}
    for r in ok.values():
        ddp = ok.get((r["round"], "ddp"))
        if ddp:
            r["x_time_vs_ddp"] = r["step_ms"] / ddp["step_ms"]
        flat = ok.get((r["round"], FLAT_OF.get(r["policy"], "")))
        if flat:
            r["x_time_vs_flat"] = r["step_ms"] / flat["step_ms"]


def summarize(rows: list[dict[str, Any]], policies: list[str]) -> list[dict[str, Any]]:
    """One row per policy: step time the median over rounds (each round's listed), each time
    ratio the median of the per-round ratios with its spread; bytes and loss are the same
    every round (the last ok round's). Then the byte ratios hybrid / flat and / ddp."""
    out = []
    for pol in policies:
        runs = [r for r in rows if r["policy"] == pol]
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            out.append({k: v for k, v in runs[0].items() if k != "round"})
            continue
        row = {k: v for k, v in ok[-1].items() if k != "round" and not k.startswith("x_time")}
        if len(ok) < len(runs):
            bad = next(r for r in runs if r["status"] != "ok")
            row["status"] = f"ok in {len(ok)}/{len(runs)} rounds; round {bad['round']}: " + bad[
                "status"]
        ms = [r["step_ms"] for r in ok]
        row.update(rounds=len(ok), step_ms=statistics.median(ms),
                   steps_s=1e3 / statistics.median(ms),
                   step_ms_min=min(r["step_ms_min"] for r in ok),
                   step_ms_max=max(r["step_ms_max"] for r in ok),
                   step_ms_rounds=" / ".join(f"{x:.0f}" for x in ms))
        for k in ("x_time_vs_ddp", "x_time_vs_flat"):
            row.update(H.ratio_stats([r[k] for r in ok if k in r], k))
        out.append(row)
    by = {r["policy"]: r for r in out if "state_mb" in r}
    for r in out:
        ddp, flat = by.get("ddp"), by.get(FLAT_OF.get(r["policy"], ""))
        if "state_mb" in r and ddp:
            r["x_mem_vs_ddp"] = r["state_mb"] / ddp["state_mb"]
        if "state_mb" in r and flat:
            r["x_mem_vs_flat"] = r["state_mb"] / flat["state_mb"]
            for k in ("shard_mb", "inter_mb"):
                if r.get(k) is not None and flat.get(k):
                    r[f"x_{k[:-3]}_vs_flat"] = r[k] / flat[k]
    return out


def predictions(psi: int, shape: tuple[int, int], nbytes: int,
                bucket_numel: int | None) -> list[dict[str, Any]]:
    """The time model (zerokern.comm_model: ring collectives, alpha-beta, no overlap) on this
    run's parameter count: communication seconds per step, flat against hybrid, stages 1-3,
    on this run's R x S with the link calibrated on this machine's gloo (one link: no slow
    one here), then with typical GPU links (200 GB/s in a node, 25 GB/s across) at R x S,
    2 x 8 and 16 x 8."""
    from zerokern.comm_model import DEFAULT_BUCKET_NUMEL, link_traffic

    bucket = bucket_numel or DEFAULT_BUCKET_NUMEL
    cases = [(name, shape, link, link) for name, link in CALIBRATED.items()]
    cases += [("GPU 200 / 25 GB/s", sh, *GPU_LINKS)
              for sh in dict.fromkeys([shape, (2, 8), (16, 8)])]
    rows = []
    for name, (r, s), intra, inter in cases:
        cl = Cluster(r, s, intra, inter)
        for stage in (1, 2, 3):
            t, inter_mb = {}, {}
            for hyb in (False, True):
                cs = step_collectives(stage, psi, cl, hyb, nbytes, nbytes, bucket)
                t[hyb] = step_seconds(cs, cl)["total"]
                inter_mb[hyb] = link_traffic(cs, cl)["inter"]["bytes"] / H.MB
            rows.append({"links": name, "cluster": f"{r} x {s}", "stage": stage,
                         "flat_ms": t[False] * 1e3, "hybrid_ms": t[True] * 1e3,
                         "x_hybrid_vs_flat": t[True] / t[False],
                         "inter_mb_flat": inter_mb[False], "inter_mb_hybrid": inter_mb[True]})
    return rows


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    """The summary rows as a markdown table (ratios: median over rounds (min-max))."""
    cols = [("policy", "policy"), ("layout", "layout"), ("status", "status"),
            ("step_ms", "step ms: median (each round)"),
            ("x_time_vs_flat", "time / flat"), ("x_time_vs_ddp", "time / ddp"),
            ("state_mb", "model state MB/rank"), ("x_mem_vs_flat", "mem / flat"),
            ("x_mem_vs_ddp", "mem / ddp"), ("shard_mb", "shard dim MB/step"),
            ("replicate_mb", "replicate dim MB/step"), ("world_mb", "world dim MB/step (hpZ)"),
            ("calls", "calls shard + replicate"),
            ("inter_mb", "inter-node link MB/step"),
            ("x_inter_vs_flat", "inter / flat"), ("loss", "final loss")]
    lines = [header, "", "| " + " | ".join(c[1] for c in cols) + " |",
             "|" + "|".join("---" if i < 3 else "---:" for i in range(len(cols))) + "|"]
    for r in rows:
        cells = []
        for k, _ in cols:
            v = r.get(k, "")
            if k == "step_ms" and v != "":
                v = f"{v:.0f} ({r['step_ms_rounds']})"
            elif k == "calls" and "shard_calls" in r:
                v = f"{r['shard_calls']} + {r['replicate_calls']}"
            elif k.startswith("x_time") and v != "":
                v = f"{v:.3f} ({r[k + '_min']:.3f}-{r[k + '_max']:.3f})"
            elif isinstance(v, float):
                v = f"{v:.3f}" if k.startswith("x_") or k == "loss" else f"{v:.2f}"
            cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_predictions(rows: list[dict[str, Any]], psi: int, nbytes: int) -> str:
    lines = [f"Predicted communication per step (zerokern.comm_model, ring alpha-beta, no "
             f"overlap) for these {psi / 1e6:.2f}M parameters, {nbytes}-byte gradients and "
             f"parameters:", "",
             "| links | nodes x GPUs | stage | flat ms | hybrid ms | hybrid / flat | "
             "inter-node link MB flat | hybrid |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['links']} | {r['cluster']} | {r['stage']} | {r['flat_ms']:.3f} | "
                     f"{r['hybrid_ms']:.3f} | {r['x_hybrid_vs_flat']:.3f} | "
                     f"{r['inter_mb_flat']:.2f} | {r['inter_mb_hybrid']:.2f} |")
    return "\n".join(lines)


# The --mesh workload: the reference GPT (bench_zero.REFERENCE) is too slow for 4 ranks on the
# 2-core VMs (9 policies x 2 rounds in under 5 minutes), so 4 blocks of width 256 (5.3M
# parameters: three of ZeroAdamW's 2**21-element buckets, so stages 1-2 pipeline several).
MESH_WORKLOAD = dict(cfg=GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab=4096, seq=128),
                     micro_batch=2, steps=6)


def main_mesh(args: Any, ref: dict[str, Any] | None, command: str) -> int:
    """bench_zero.py --mesh: every precision asked for, all policies in one set of ranks,
    ``args.repeats`` interleaved rounds; the tables on stdout (and the time model's
    predictions), the CSVs in args.out. ``ref``: the --quick workload, or None for
    MESH_WORKLOAD."""
    import tempfile
    from dataclasses import asdict

    from zerokern.comm.rendezvous import file_init_method

    ref = ref or MESH_WORKLOAD
    cfg = ref["cfg"]
    steps = args.steps or ref["steps"]
    mb = args.micro_batch or ref["micro_batch"]
    device = torch.device(args.device)
    r, s = args.mesh
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks' setting, so machine() reports it
    meta = H.machine(device)
    psi = cfg.num_params()
    meta.update(world_size=r * s, mesh=f"{r}x{s}",
                backend="nccl" if device.type == "cuda" else "gloo",
                model=f"GPT {cfg.n_layer}x{cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab}, "
                f"seq {cfg.seq}, {psi / 1e6:.2f}M params",
                micro_batch=mb, global_batch=mb * r * s, steps=steps)
    print(f"# {meta['device']} | torch {meta['torch']} | {meta['date']} | {meta['model']} | "
          f"mesh {r}x{s} ({r * s} ranks, {meta['backend']}), micro-batch {mb}, {steps} steps, "
          f"{args.repeats} rounds in one set of ranks")
    for prec in args.precision:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="bench_zero_mesh_") as tmp:
            job = MeshJob(list(args.policies), prec, device.type, asdict(cfg), mb, steps,
                          args.repeats, (r, s), file_init_method(tmp), tmp, args.bucket_numel)
            runs = run_mesh(job, args.timeout)
        wall = time.perf_counter() - t0
        runs = [{**x, "precision": prec, **meta} for x in runs]
        add_round_ratios(runs)
        rows = summarize(runs, list(args.policies))
        for x in runs:
            if x["status"] != "ok":
                print(f"# round {x['round']}, {x['policy']} ({prec}): {x['status']}")
        print(f"\n## {prec} ({wall:.0f} s)")
        H.print_table([{**x, "status": x["status"][:40]} for x in rows],
                      ["policy", "layout", "status", "step_ms", "step_ms_rounds",
                       "x_time_vs_flat", "x_time_vs_flat_min", "x_time_vs_flat_max",
                       "x_time_vs_ddp", "state_mb", "x_mem_vs_flat", "shard_mb",
                       "replicate_mb", "world_mb", "shard_wire_mb", "replicate_wire_mb",
                       "shard_calls", "replicate_calls", "inter_mb",
                       "x_inter_vs_flat", "loss"])
        for x in rows:
            if "optim" in x:
                print(f"#   {x['policy']}: {x['optim']}")
        nbytes = 2 if prec == "bf16" else 4
        header = (f"**{prec}**, {meta['device']}, torch {meta['torch']}, {meta['date']}: "
                  f"{meta['model']}, mesh {r}x{s} ({r * s} ranks over {meta['backend']}, "
                  f"dim 0 replicates, dim 1 shards), micro-batch {mb}/rank, median of steps "
                  f"3..{steps}, {args.repeats} interleaved rounds in one set of ranks "
                  f"({wall:.0f} s), ratios within a round: median (min-max).  \n`{command}`")
        print("\n" + markdown(rows, header))
        pred = predictions(psi, (r, s), nbytes, args.bucket_numel)
        print("\n" + markdown_predictions(pred, psi, nbytes))
        name = (f"bench_zero_{device.type}_{prec}_{meta['date']}_mesh{r}x{s}"
                f"{'_quick' if args.quick else ''}")
        for rows_, suffix in ((rows, ""), (runs, "_rounds"),
                              ([{**p, **meta} for p in pred], "_predicted")):
            print(f"# wrote {H.write_csv(rows_, name + suffix + '.csv', args.out)}")
    return 0
