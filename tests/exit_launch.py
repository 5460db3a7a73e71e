"""Launch tests/exit_case.py on N local ranks (plain processes, a file rendezvous: no port to
race for) and report each rank's exit status: scripts/stress_exit.sh, and `Zygote` (forked
ranks from a process that imported torch once) for the default suite, tests/test_exit.py."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASE = Path(__file__).with_name("exit_case.py")
STAGES = (0, 1, 2, 3)
MODES = ("destroy", "nodestroy", "alive", "exception", "nostep")


def run_case(
    stage: int, mode: str, world: int = 2, timeout: float = 120.0
) -> list[tuple[int, str]]:
    """Run one case; returns (exit status, stderr tail) per rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as d:
        init = str(Path(d, "rendezvous"))
        procs = [
            subprocess.Popen(
                [sys.executable, str(CASE), str(stage), mode, str(r), str(world), init],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True,
            )
            for r in range(world)
        ]
        out = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
                err = f"timed out after {timeout} s\n{err}"
            out.append((p.returncode, err[-2000:]))
        return out


class Zygote:
    """tests/exit_zygote.py as a subprocess: run_case() forks the ranks from it."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(CASE.with_name("exit_zygote.py"))], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, text=True,
        )

    def run_case(self, stage: int, mode: str, world: int = 2) -> list[tuple[int, str]]:
        with tempfile.TemporaryDirectory() as d:
            req = dict(stage=stage, mode=mode, world=world, init=str(Path(d, "rendezvous")))
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the exit zygote died (exit code {self.proc.wait()})")
        return [(rc, err) for rc, err in json.loads(line)]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", type=int, help="runs of every stage x mode")
    ap.add_argument("--stages", type=int, nargs="*", default=list(STAGES))
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    args = ap.parse_args()
    total = bad = 0
    for stage in args.stages:
        for mode in args.modes:
            fails = 0
            for _ in range(args.runs):
                res = run_case(stage, mode)
                if any(rc != 0 for rc, _ in res):
                    fails += 1
                    codes = [rc for rc, _ in res]
                    tail = next(e for rc, e in res if rc != 0).strip().splitlines()[-1:]
                    print(f"  stage {stage} {mode}: exit codes {codes}: {tail}", flush=True)
            print(f"stage {stage} {mode:9s}: {fails} of {args.runs} runs exited non-zero",
                  flush=True)
            total += args.runs
            bad += fails
    print(f"total: {bad} of {total} runs exited non-zero")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
