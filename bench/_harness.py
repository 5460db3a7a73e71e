"""Shared benchmark plumbing: timing (warm-up, repeats, median and spread), a memory-bandwidth
probe measured in the same run, machine metadata, CSV and optional PNG output."""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 2,
    repeats: int = 5,
    min_time_s: float = 0.0,
) -> dict[str, float]:
    """Median/min/max milliseconds of `fn` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    start_all = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start_all) < min_time_s:
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        if len(times) >= 200:
            break
    return {
        "ms": statistics.median(times),
        "ms_min": min(times),
        "ms_max": max(times),
        "repeats": len(times),
    }


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Achievable memory bandwidth in GB/s (bytes read + written), measured in this run: the
    best of a large copy and a STREAM-style add (c = a + b), since torch's CPU copy alone
    can stay well below what a multi-stream kernel reaches."""
    n = nbytes // 4
    a = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a).fill_(2.0)
    c = torch.empty_like(a)
    t_copy = time_fn(lambda: c.copy_(a), device, warmup=2, repeats=7)["ms"]
    t_add = time_fn(lambda: torch.add(a, b, out=c), device, warmup=2, repeats=7)["ms"]
    return max(2 * nbytes / (t_copy * 1e-3), 3 * nbytes / (t_add * 1e-3)) / 1e9


def machine(device: torch.device) -> dict[str, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        name = f"{name}, {torch.get_num_threads()} threads"
    import triton  # noqa: F401  (version only)

    return {
        "device": name,
        "date": _dt.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": getattr(triton, "__version__", "?"),
        "host": platform.node(),
    }


def write_csv(
    rows: Sequence[dict[str, object]], name: str, out_dir: str | Path | None = None
) -> Path:
    out = Path(out_dir or os.environ.get("ZEROKERN_BENCH_OUT") or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def print_table(rows: Sequence[dict[str, object]], cols: Sequence[str]) -> None:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.rjust(w) for v, w in zip(x, widths)))
