"""The CPU AdamW kernels of two (or more) builds side by side: before/after in one run.

    python bench/bench_adam_builds.py --tree before=/path/to/old/checkout --tree after=.
    OMP_NUM_THREADS=1 python bench/bench_adam_builds.py --tree a=/old --tree b=. --clock cpu

Each --tree is a checkout (or any folder holding a ``zerokern`` package) with its native
extension built. Two builds cannot share one process (both register the same pybind11 types),
so each round starts one child process per tree, in turn (a, b, a, b, ...): the builds see the
same machine state, round by round. A child steps one flat range of n elements with each
kernel (``zerokern.ops`` on the ``cpu`` backend, so the same call works on any build since
issue 27) ``--calls`` times, from the same seeded inputs, and reports its best call; the
ratios are taken within a round (first tree's time / each other tree's), median and spread
over the rounds. Kernels:
  adam            fused_adamw_: bf16 grad, fp32 master and moments, bf16 param copy
  fp32, bf16      fused_adamw_compressed_ with fp32 / bf16 moments, fp32 master, bf16 copy
  int8            8-bit moments, fp32 master, bf16 copy
  int8_nomaster   8-bit moments, the bf16 param itself (stochastic rounding)
  int8v3, int8v3_nomaster   the same two with int8 format version 3 (a build that has it)
``--clock cpu`` times each call by the thread's CPU time (1 thread, shared machines).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

KERNELS = ("adam", "fp32", "bf16", "int8", "int8_nomaster", "int8v3", "int8v3_nomaster")
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def child(n: int, kernels: list[str], calls: int, clock: str) -> dict[str, float]:
    """Run in a tree's child process: the best time of each kernel, in seconds."""
    import torch

    from zerokern import ops

    tick = time.thread_time if clock == "cpu" else time.perf_counter
    nb = -(-n // 256)
    best: dict[str, float] = {}
    for k in kernels:
        gen = torch.Generator().manual_seed(0)
        grad = torch.randn(n, generator=gen).bfloat16()
        master = torch.randn(n, generator=gen) * 0.02
        lp = master.bfloat16()
        kw: dict = {}
        if k in ("adam", "fp32", "bf16"):
            dt = torch.bfloat16 if k == "bf16" else torch.float32
            m, v = torch.zeros(n, dtype=dt), torch.zeros(n, dtype=dt)
        else:
            m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
            kw = dict(exp_avg_absmax=torch.zeros(nb), exp_avg_sq_absmax=torch.zeros(nb))
        if k.startswith("int8v3"):
            kw["format_version"] = 3
        if k.endswith("_nomaster"):  # the bf16 param itself, stochastic rounding
            param = lp
            kw.update(sr_index=torch.arange(nb, dtype=torch.int64) * 256, seed=1234)
        else:
            param = master
            kw.update(param_lp=lp)
        step_fn = ops.fused_adamw_ if k == "adam" else ops.fused_adamw_compressed_
        times = []
        for step in range(1, calls + 1):
            t0 = tick()
            step_fn(param, grad, m, v, step=step, backend="cpu", **kw, **HP)
            times.append(tick() - t0)
        best[k] = min(times[1:] or times)  # the first call also touches the pages
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                    help="a build to time (repeatable; the first is the ratios' numerator)")
    ap.add_argument("--size", type=int, default=24, help="log2 of the elements (default 24)")
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    ap.add_argument("--rounds", type=int, default=3, help="rounds of one child per tree")
    ap.add_argument("--calls", type=int, default=4, help="calls per kernel in a child")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    n = 1 << a.size
    if a.child:
        print(json.dumps(child(n, a.kernels, a.calls, a.clock)), flush=True)
        return 0
    trees = [t.split("=", 1) for t in a.tree]
    if len(trees) < 1 or any(len(t) != 2 for t in trees):
        ap.error("give at least one --tree LABEL=PATH")
    for label, path in trees:
        if not (Path(path) / "zerokern").is_dir():
            ap.error(f"--tree {label}={path}: no zerokern package there")
    res: dict[tuple[str, str], list[float]] = {}
    for _ in range(a.rounds):
        for label, path in trees:
            env = dict(os.environ, PYTHONPATH=str(Path(path).resolve()))
            cmd = [sys.executable, __file__, "--child", label, "--size", str(a.size),
                   "--calls", str(a.calls), "--clock", a.clock, "--kernels", *a.kernels]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if out.returncode:
                sys.exit(f"{label}: {out.stderr[-2000:]}")
            for k, t in json.loads(out.stdout.strip().splitlines()[-1]).items():
                res.setdefault((k, label), []).append(t)
    first = trees[0][0]
    print(f"2^{a.size} elements, {a.rounds} rounds, best of {a.calls} calls per child, "
          f"{a.clock} clock, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}")
    for k in a.kernels:
        cols = []
        for label, _ in trees:
            ts = res[(k, label)]
            cols.append(f"{label} {statistics.median(ts) * 1e3:8.2f} ms "
                        f"({statistics.median(ts) * 1e9 / n:.2f} ns/elt)")
        for label, _ in trees[1:]:
            r = [x / y for x, y in zip(res[(k, first)], res[(k, label)], strict=True)]
            cols.append(f"{first}/{label} {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")
        print(f"{k:14s} " + "  ".join(cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
