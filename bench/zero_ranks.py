"""The ranks of one bench_zero.py policy: spawned fresh, trained, their results combined.

``run_policy`` (the driver side) spawns ``job.world`` processes, waits for them and turns what
they wrote into one row. ``worker`` (the rank side) forms the process group through the job's
file rendezvous, builds the policy (zero_policies.build), runs the timed steps and then the
profiled ones, and writes its result, or its error, as JSON into ``job.outdir``: a failing
policy becomes a row with a status instead of ending the run. ``run_policy(..., tree=PATH)``
makes the ranks import zerokern from another checkout (bench_zero.py --tree), for before/after
comparisons of the engine in one run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _harness import MB, comm_from_profile, join_ranks, rank_start_method
from gpt import GPTConfig, batch
from zero_policies import Job, Setup, Skip, build


# -- one rank -----------------------------------------------------------------------------------
def worker(rank: int, job: Job) -> None:
    # Not read by torch (the rendezvous is job.init_method) but by DeepSpeed, which expects a
    # launcher's environment (LOCAL_RANK for its device, RANK for who logs).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job.world))
    out = Path(job.outdir)
    try:
        result = run_rank(rank, job)
    except BaseException as exc:
        kind = (
            "skipped"
            if isinstance(exc, Skip)
            else ("oom" if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) else "error")
        )
        (out / f"rank{rank}.err").write_text(
            json.dumps(
                {
                    "kind": kind,
                    "msg": f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                    "traceback": traceback.format_exc(),
                }
            )
        )
        raise
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def run_rank(rank: int, job: Job) -> dict[str, Any]:
    # torch 2.14 deprecates reduce_scatter_tensor / all_gather_into_tensor (the libraries
    # measured still call them): one warning per rank and call site is noise here.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    cuda = job.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    ds = job.policy.startswith("ds_")
    if ds:
        if not cuda:
            os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is imported
        try:
            import deepspeed
        except Exception as exc:  # not installed, or broken: never a dependency
            raise Skip(f"import deepspeed failed: {type(exc).__name__}: {exc}") from exc
        deepspeed.utils.logger.setLevel(logging.WARNING)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=job.init_method,
        rank=rank,
        world_size=job.world,
        device_id=device if cuda else None,
    )
    try:
        _parallelize_for_older_trees()
        if ds:
            # Finding torch's group formed, DeepSpeed adopts it instead of forming its own
            # (which would want a launcher's MASTER_ADDR/MASTER_PORT, or MPI).
            deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        res = train(rank, job, device, build(job, device))
        # Which checkout the engine came from: the driver checks it against --tree.
        import zerokern

        res["zerokern_dir"] = str(Path(zerokern.__file__).resolve().parent)
        return res
    finally:
        dist.destroy_process_group()


def _parallelize_for_older_trees() -> None:
    """zero_policies builds zerokern's rows with ``zerokern.parallelize``. A --tree checkout
    older than it (zerokern/compose.py) gets, in this rank only, the two calls parallelize is
    documented to equal bitwise, as the bench wrote them before: ``shard_model`` in place at
    stage 3 (its default units), then ``ZeroAdamW`` on the model's parameters. Only the
    arguments the bench passes are taken, so a policy that wants more fails loudly."""
    import zerokern

    if hasattr(zerokern, "parallelize"):
        return

    def parallelize(model: torch.nn.Module, *, stage: int, offload: str | None = None,
                    offload_params: bool = False, **adamw_kwargs: Any) -> Any:
        if stage == 3:
            zerokern.shard_model(model, offload_params=offload_params)
        elif offload_params:
            raise ValueError("offload_params needs stage 3")
        return zerokern.ZeroAdamW(model.parameters(), stage=stage, offload=offload,
                                  **adamw_kwargs)

    zerokern.parallelize = parallelize


def train(rank: int, job: Job, device: torch.device, s: Setup) -> dict[str, Any]:
    cfg = GPTConfig(**job.cfg)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    times, losses = [], []
    host: list[tuple[float, float, int]] = []  # offload rows: the host step (host_step.py)
    for step in range(1, job.steps + 1):
        x, y = batch(step, rank, job.micro_batch, cfg.seq, cfg.vocab, device)
        sync()
        t0 = time.perf_counter()
        loss = s.step(x, y)
        sync()
        times.append(time.perf_counter() - t0)
        if s.host_timer is not None:
            host.append(s.host_timer.take())
        losses.append(float(loss.detach().float()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss is {losses[-1]} at step {step}")
    res: dict[str, Any] = {"times": times, "losses": losses, "optim": s.optim}
    if host:
        res["host_times"] = [w for w, _, _ in host]
        res["host_cpu_times"] = [c for _, c, _ in host]
        res["host_numel"] = max(n for _, _, n in host)
    res.update({f"{k}_bytes": v for k, v in s.state().items()})
    if device.type == "cuda":
        res["max_alloc"] = torch.cuda.max_memory_allocated(device)
        res["max_reserved"] = torch.cuda.max_memory_reserved(device)
    else:
        res["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if job.prof_steps > 0:
        # Extra steps after the timed ones, so that the profiler's overhead is in no timing.
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        dist.barrier()
        with profile(activities=acts, record_shapes=True) as prof:
            for step in range(job.steps + 1, job.steps + 1 + job.prof_steps):
                x, y = batch(step, rank, job.micro_batch, cfg.seq, cfg.vocab, device)
                s.step(x, y)
            sync()
        res.update(comm_from_profile(prof, device, job.prof_steps, job.world))
    return res


# -- driver -------------------------------------------------------------------------------------
@contextlib.contextmanager
def imports_from(tree: Path | None) -> Iterator[None]:
    """Processes spawned inside this block import zerokern from ``tree`` (a checkout whose
    ``zerokern`` package sits at ``tree/zerokern``); None: from wherever this process does.

    Why the parent's own sys.path: a spawned child takes its sys.path from the parent at the
    moment of the spawn (multiprocessing sends it with the preparation data, which overrides
    the child's PYTHONPATH), and it imports zerokern while re-running the main script, before
    any argument of the worker is unpickled. So the tree goes first on the parent's sys.path
    while the ranks start, and is taken off again; the parent's modules are already imported
    and stay as they are. PYTHONPATH is set too, for processes the ranks start themselves.
    An installed editable finder does not get in the way: it sits after sys.path's finder."""
    if tree is None:
        yield
        return
    entry = str(tree)
    old_env = os.environ.get("PYTHONPATH")
    sys.path.insert(0, entry)
    os.environ["PYTHONPATH"] = entry + (os.pathsep + old_env if old_env else "")
    try:
        yield
    finally:
        sys.path.remove(entry)
        if old_env is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old_env


def run_policy(job: Job, timeout: float, tree: Path | None = None) -> dict[str, Any]:
    """Spawn the ranks, wait (at most `timeout` s), combine their results into one row.
    ``tree``: the ranks import zerokern from that checkout (checked: a rank that imported it
    from anywhere else makes the row an error) and the row says where, as ``zerokern_dir``."""
    t0 = time.perf_counter()
    with imports_from(tree):
        ctx = mp.start_processes(
            worker, args=(job,), nprocs=job.world, join=False, start_method=rank_start_method()
        )
    failure = join_ranks(ctx, t0, timeout)
    failure = None if failure is None else f"error: {failure}"
    out = Path(job.outdir)
    errs = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.err"))]
    if errs:
        # A skip or an out-of-memory explains the others' errors (their peer vanished).
        e = next((x for x in errs if x["kind"] != "error"), errs[0])
        if e["kind"] == "error":
            print(f"# {job.policy} failed:\n{e['traceback']}", file=sys.stderr)
        return {"status": f"{e['kind']}: {e['msg']}" if e["kind"] != "oom" else "oom"}
    ranks = [
        json.loads((out / f"rank{r}.json").read_text())
        for r in range(job.world)
        if (out / f"rank{r}.json").exists()
    ]
    if failure or len(ranks) != job.world:
        return {"status": failure or "error: a rank wrote no result"}
    row = combine(ranks, job.steps)
    if tree is not None:
        want = str((tree / "zerokern").resolve())
        got = {r["zerokern_dir"] for r in ranks}
        if got != {want}:
            return {"status": f"error: ranks imported zerokern from {sorted(got)}, not {want}"}
        row["zerokern_dir"] = want
    return row


def combine(ranks: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """One row from the ranks' results (bench/README.md: how each column combines them)."""
    per_step = [max(r["times"][i] for r in ranks) for i in range(steps)]
    # Steps 1 and 2 pay one-time costs (allocation, layouts, autotuning): not in the median.
    window = per_step[2:] if steps >= 3 else per_step[-1:]
    med = statistics.median(window)
    row: dict[str, Any] = {
        "status": "ok",
        "steps_s": 1.0 / med,
        "step_ms": med * 1e3,
        "step_ms_min": min(window) * 1e3,
        "step_ms_max": max(window) * 1e3,
        "first_step_ms": per_step[0] * 1e3,
    }
    for k in ("params", "grads", "optim"):
        row[f"{k}_mb"] = max(r.get(f"{k}_bytes", 0) for r in ranks) / MB
    row["state_mb"] = (
        max(sum(r.get(f"{k}_bytes", 0) for k in ("params", "grads", "optim")) for r in ranks) / MB
    )
    if "comm_bytes" in ranks[0]:
        row["comm_mb"] = ranks[0]["comm_bytes"] / MB
        row["comm_ms"] = max(r["comm_ms"] for r in ranks)
        row["comm_kinds"] = ranks[0]["comm_kinds"]
    if "zk_comm_bytes" in ranks[0]:
        row["zk_comm_mb"] = ranks[0]["zk_comm_bytes"] / MB
    if "rss" in ranks[0]:
        row["rss_mb"] = max(r["rss"] for r in ranks) / MB
    if "max_alloc" in ranks[0]:
        row["max_alloc_mb"] = max(r["max_alloc"] for r in ranks) / MB
        row["max_reserved_mb"] = max(r["max_reserved"] for r in ranks) / MB
    if all("host_times" in r for r in ranks):
        # The host step alone (offload rows), combined as the step is: the slowest rank per
        # step, the median over the same window; its shard the largest rank's. "_cpu": by
        # the thread's CPU time (host_step.HostStepTimer).
        row["host_numel"] = max(r["host_numel"] for r in ranks)
        for clock in ("", "_cpu"):
            host = [max(r[f"host{clock}_times"][i] for r in ranks) for i in range(steps)]
            ms = statistics.median(host[2:] if steps >= 3 else host[-1:]) * 1e3
            row[f"host{clock}_step_ms"] = ms
            row[f"host{clock}_ns_per_elt"] = ms * 1e6 / max(row["host_numel"], 1)
    row["loss"] = statistics.fmean(r["losses"][-1] for r in ranks)
    row["optim"] = ranks[0]["optim"]
    return row
