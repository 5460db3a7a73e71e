"""Run a function on N CPU ranks over gloo, for the multi-rank tests.

The ranks are a pool of long-lived processes per (world size, backend), formed once through a
file rendezvous (no port to race for) and reused by every test of the session: spawning and
initialising a group costs seconds per test on a 2-core machine, running a case costs tens of
milliseconds. A case's functions must therefore leave no state behind (process-wide settings,
subgroups); a case that must poison its group (a collective timeout) passes ``isolated=True``
and gets ranks of its own.

An exception on any rank fails the test with every failing rank's traceback. After a failure
the pool is discarded (its group may be mid-collective) and the next test forms a new one.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from zerokern.comm.rendezvous import file_init_method

# A case that runs longer than this is treated as hung (the group timeout is 30 minutes).
CASE_TIMEOUT_S = 300.0
# Once one rank has failed, the others get this long to report before the pool is killed
# (they may be blocked in a collective the failed rank never joined).
GRACE_S = 10.0


def _serve(rank: int, world: int, backend: str, init_method: str, conn: Connection,
           environ: dict[str, str]) -> None:
    # The environment of the pool's creation, as a spawned rank would have it (a forked one
    # has the fork server's, from when the server started).
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:
            break
        if not payload:
            break
        try:
            fn, args, kwargs = pickle.loads(payload)
            if kwargs:
                fn(rank, world, **args[0])
            else:
                fn(rank, world, *args)
            conn.send(("ok", ""))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


def rank_context() -> Any:
    """How ranks start: forked from a server that imported torch once ("forkserver", torch
    preloaded, as the benches start theirs), instead of each importing it again ("spawn"):
    seconds of CPU per rank on a 2-core machine, and a session starts tens of ranks (a pool
    per world size and worker, isolated cases, pools replaced after a failure). The server
    imports torch and torch._dynamo (which every rank imports when it builds an optimizer:
    torch.optim.Optimizer.add_param_group is wrapped by torch._disable_dynamo) and nothing
    else: no CUDA context, no process group, no thread pool yet; each rank then prepares
    itself as a spawned one would (sys.path, the main module) and imports the rest."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo"])
    return mp.get_context("forkserver")


class _Pool:
    def __init__(self, world: int, backend: str) -> None:
        self.world = world
        self.dir = tempfile.mkdtemp(prefix=f"zk-ranks{world}-")
        ctx = rank_context()
        self.conns: list[Connection] = []
        self.procs = []
        init_method = file_init_method(self.dir)
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve,
                            args=(r, world, backend, init_method, child, dict(os.environ)),
                            daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, payload: bytes, timeout: float) -> dict[int, str]:
        """Run one case on every rank; the failing ranks' messages (empty when all passed)."""
        for c in self.conns:
            c.send_bytes(payload)
        pending = set(range(self.world))
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                for r in sorted(pending):
                    errors[r] = (f"rank {r} did not finish within "
                                 f"{GRACE_S if errors else timeout:.0f} s"
                                 + (" of another rank's failure" if errors else ""))
                break
            waitables: list[Any] = []
            for r in pending:
                waitables += [self.conns[r], self.procs[r].sentinel]
            ready = wait(waitables, timeout=left)
            for r in list(pending):
                if self.conns[r] in ready:
                    try:
                        status, msg = self.conns[r].recv()
                    except EOFError:
                        status, msg = "error", ""
                    if status != "ok":
                        errors[r] = msg or f"rank {r} closed its pipe"
                    pending.discard(r)
                elif self.procs[r].sentinel in ready:
                    self.procs[r].join(1)
                    errors[r] = f"rank {r} died (exit code {self.procs[r].exitcode})"
                    pending.discard(r)
            if errors:
                deadline = min(deadline, time.monotonic() + GRACE_S)
        return errors

    def close(self, graceful: bool) -> None:
        if graceful:
            for c in self.conns:
                try:
                    c.send_bytes(b"")
                except OSError:
                    pass
            for p in self.procs:
                p.join(10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict[tuple[int, str], _Pool] = {}


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close(graceful=True)


def run_ranks(
    world: int, fn, *args, tmp_path: Path, kwargs: bool = False, backend: str = "gloo",
    isolated: bool = False, timeout: float = CASE_TIMEOUT_S,
) -> None:
    """fn(rank, world, *args) on every rank; with kwargs=True, fn(rank, world, **args[0]).
    ``fn`` and its arguments are pickled (functions by reference: define them at module
    level). ``isolated`` runs the case on fresh ranks that are discarded afterwards."""
    del tmp_path  # kept in the signature: cases get their own tmp_path through args
    payload = pickle.dumps((fn, args, kwargs))
    key = (world, backend)
    pool = _Pool(world, backend) if isolated else _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = _Pool(world, backend)
    errors: dict[int, str] = {}
    try:
        errors = pool.run(payload, timeout)
    except BaseException:  # e.g. KeyboardInterrupt: the ranks are mid-case
        errors = {-1: "interrupted"}
        raise
    finally:
        if errors or isolated:
            if _POOLS.get(key) is pool:
                del _POOLS[key]
            # An isolated case's group may be poisoned on purpose (a timeout): no teardown.
            pool.close(graceful=not errors and not isolated)
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{m}" for r, m in sorted(errors.items()))
        raise AssertionError("a rank failed:\n" + text)
