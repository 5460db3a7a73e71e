"""Run a function on N CPU ranks over gloo (torch.multiprocessing), for the multi-rank tests.
An exception on any rank fails the test with that rank's traceback."""

from __future__ import annotations

import gc
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world: int, port: int, fn, args, errdir: str, kwargs: bool, backend: str = "gloo"
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world)
        try:
            if kwargs:
                fn(rank, world, **args[0])
            else:
                fn(rank, world, *args)
        finally:
            # Collect dead tensors while gloo's threads are alive: without it a worker thread
            # was seen freeing its last collective's tensors during interpreter shutdown
            # (a C++ terminate at exit, about one run in seven).
            gc.collect()
            dist.destroy_process_group()
    except BaseException:
        Path(errdir, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(
    world: int, fn, *args, tmp_path: Path, kwargs: bool = False, backend: str = "gloo"
) -> None:
    """fn(rank, world, *args) on every rank; with kwargs=True, fn(rank, world, **args[0])."""
    for attempt in range(2):
        errdir = tmp_path / f"errors{attempt}"
        errdir.mkdir(exist_ok=True)
        try:
            mp.start_processes(
                _worker,
                args=(world, free_port(), fn, args, str(errdir), kwargs, backend),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
            return
        except Exception as exc:
            msgs = [p.read_text() for p in sorted(errdir.glob("rank*.txt"))]
            if msgs or attempt == 1:
                raise AssertionError("a rank failed:\n" + "\n".join(msgs or [str(exc)])) from exc
            # A rank died without a Python traceback (seen once under heavy load as a
            # C++ terminate during gloo set-up): one fresh retry on a new port; a real bug in
            # our code fails the same way twice.
            print(f"run_ranks: a rank died without a traceback ({exc}); retrying once")
