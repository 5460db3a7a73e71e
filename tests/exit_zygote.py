"""A fork server for the exit cases of the default suite (tests/test_exit.py): it imports
torch and zerokern once, then for every case forks one child per rank. Each child runs
tests/exit_case.py as __main__ and leaves through a normal interpreter exit (atexit hooks,
Py_FinalizeEx, the gloo threads it started still alive): the path the abort happened on, at
a fraction of the cost of starting two interpreters per case. scripts/stress_exit.sh starts
real interpreters instead (tests/exit_launch.py).

Protocol: one JSON line per case on stdin ({"stage", "mode", "world", "init"}), one JSON line
back with every rank's exit status (negative: killed by that signal) and stderr tail.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

CASE = str(Path(__file__).with_name("exit_case.py"))
_KEEP: dict = {}  # the case's globals: "alive" keeps its model and optimizer until exit


def _child(stage: int, mode: str, rank: int, world: int, init: str, err_path: str) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(err, 2)
    sys.argv = [CASE, str(stage), mode, str(rank), str(world), init]
    try:
        _KEEP.update(runpy.run_path(CASE, run_name="__main__"))
    except SystemExit as exc:
        raise exc
    except BaseException:
        import traceback

        traceback.print_exc()
        raise SystemExit(1) from None
    raise SystemExit(0)  # unwinds out of the server loop: a normal interpreter exit


def _status(raw: int) -> int:
    if os.WIFSIGNALED(raw):
        return -os.WTERMSIG(raw)
    return os.WEXITSTATUS(raw)


def main() -> None:
    import torch  # noqa: F401 - imported once here, before any fork
    import torch._dynamo  # noqa: F401 - torch.optim.Optimizer's first call imports it (2-3 s)

    import zerokern  # noqa: F401

    # What the imports made is frozen (left out of every collection, as CPython's docs advise
    # before forking workers): a child's final collection in Py_FinalizeEx would otherwise
    # traverse the whole inherited heap, and writing its headers copies every page of it
    # (seconds of CPU per rank). Everything the case itself creates is collected as usual.
    gc.freeze()

    # No `with` or `finally` around the fork: a child leaves by unwinding these frames, and
    # must not run the parent's clean-up (it would delete the folder its stderr goes to).
    for line in sys.stdin:
        req = json.loads(line)
        d = tempfile.mkdtemp(prefix="zk-exit-")
        pids, errs = [], []
        for r in range(req["world"]):
            errs.append(os.path.join(d, f"rank{r}.err"))
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(req["stage"], req["mode"], r, req["world"], req["init"], errs[-1])
            pids.append(pid)
        out = []
        for pid, e in zip(pids, errs):
            _, raw = os.waitpid(pid, 0)
            text = Path(e).read_text(errors="replace") if os.path.exists(e) else ""
            out.append([_status(raw), text[-2000:]])
        shutil.rmtree(d, ignore_errors=True)
        print(json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
