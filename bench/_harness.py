"""Shared benchmark plumbing: timing (warm-up, repeats, median and spread; providers timed in
interleaved rounds and their per-round ratios), a memory-bandwidth probe measured in the same
run, machine metadata, CSV and table output, and the two measurements of a training step that
need more than a clock: the model-state bytes a rank holds (a walk over tensor storages) and
the collectives it ran (from torch.profiler events). bench/README.md says what each
measurement counts."""

from __future__ import annotations

import csv
import datetime as _dt
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1 << 20


def rank_start_method() -> str:
    """How the benches start their ranks: "forkserver" (default), whose server imports torch
    once, so that each launch forks from it instead of importing torch again in every rank
    (seconds of CPU per rank on a small machine, where the quick runs are mostly start-up);
    or "spawn" (ZEROKERN_BENCH_START=spawn). Either way each rank imports zerokern itself,
    from the tree its launch names (bench_zero --tree), and nothing is timed before its
    ranks are up. The server imports torch and torch._dynamo (every rank imports the latter
    when it builds an optimizer: torch.optim.Optimizer.add_param_group is wrapped by
    torch._disable_dynamo; seconds more per rank) and nothing else: no CUDA context, no
    thread pool yet, and no zerokern (a --tree rank imports its own)."""
    method = os.environ.get("ZEROKERN_BENCH_START", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"ZEROKERN_BENCH_START must be 'forkserver' or 'spawn', got {method!r}")
    if method == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(["torch", "torch._dynamo"])
    return method


def join_ranks(ctx: Any, t0: float, timeout: float) -> str | None:
    """Wait for the rank processes of ``ctx`` (``torch.multiprocessing.start_processes(...,
    join=False)``, started at ``time.perf_counter()`` ``t0``); None when all ended well, else
    why not (a timeout, or the exception type of a rank that raised or died). Every rank is
    ended and reaped before it returns, so no bench leaves a rank behind."""
    failure = None
    try:
        while not ctx.join(timeout=5):
            if time.perf_counter() - t0 > timeout:
                failure = f"timed out after {timeout:.0f} s"
                break
    except Exception as exc:  # a rank raised or died: the context has ended the others
        failure = type(exc).__name__
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
            p.join(5)
    return failure


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


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    rounds: int,
    warmup: int = 2,
    min_sample_ms: float = 2.0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """One sample (ms per call) per provider and round, the providers timed in turns.

    Round r times every provider once, in the given order on even rounds and reversed on odd
    ones, so that drift of a shared machine and the position in a round fall on all providers
    alike; a ratio of two providers' samples of the same round is then a paired measurement.
    A sample is the mean of ``calls`` back-to-back calls, ``calls`` fixed per provider after
    the warm-up so that a sample lasts at least ``min_sample_ms`` (a single call of a tiny
    input is below the clock's and the launch's noise)."""
    calls: dict[str, int] = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        one = min(_timed(fn, device, 1, clock) for _ in range(3))  # a hiccup is no size
        calls[name] = max(1, min(10_000, math.ceil(min_sample_ms / max(one, 1e-3))))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(_timed(fns[name], device, calls[name], clock) / calls[name])
    return samples


def _timed(fn: Callable[[], object], device: torch.device, calls: int,
           clock: Callable[[], float] = time.perf_counter) -> float:
    """Milliseconds of ``calls`` back-to-back calls (CUDA events on GPU, ``clock`` on CPU:
    perf_counter, or time.process_time to count only this process's CPU time)."""
    sync(device)
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) * 1e3


def ratio_stats(ratios: Sequence[float], prefix: str) -> dict[str, Any]:
    """Per-round ratios summarised under ``prefix``: the median, the spread (min and max) and
    every round's value; the median is the result, the spread says how far noise moved it."""
    if not ratios:
        return {}
    return {
        prefix: statistics.median(ratios),
        f"{prefix}_min": min(ratios),
        f"{prefix}_max": max(ratios),
        f"{prefix}_rounds": " ".join(f"{x:.3f}" for x in ratios),
    }


def compare_interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    base: str,
    *,
    rounds: int,
    warmup: int = 2,
    min_sample_ms: float = 2.0,
) -> dict[str, dict[str, Any]]:
    """Per provider: ms per call (median, min, max over rounds, from ``time_interleaved``) and
    its speed-up over ``base`` in each round (base ms / provider ms, > 1 is faster), summed up
    by ``ratio_stats`` as ``x_vs_base`` (median), ``_min``, ``_max`` and ``_rounds``."""
    samples = time_interleaved(fns, device, rounds=rounds, warmup=warmup,
                               min_sample_ms=min_sample_ms)
    out: dict[str, dict[str, Any]] = {}
    for name, ms in samples.items():
        out[name] = {
            "ms": statistics.median(ms),
            "ms_min": min(ms),
            "ms_max": max(ms),
            "rounds": len(ms),
            **ratio_stats([b / m for b, m in zip(samples[base], ms)], "x_vs_base"),
        }
    return out


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


TRIAD_BYTES_PER_ELEM = 12.0
"""A STREAM triad ``a = b + s * c`` on fp32 moves 12 bytes per element (two reads, a write)."""


def triad(n: int, device: torch.device) -> Callable[[], object]:
    """A STREAM-like triad over ``n`` fp32 elements (``a = b + 3 c``), its pages touched
    before it is returned (first-touch page faults are not bandwidth): time it like any
    provider, in the same interleaved rounds, and read the best round as the machine's
    limit at that size (the triad counts TRIAD_BYTES_PER_ELEM bytes per element)."""
    a = torch.zeros(n, device=device)
    b = torch.ones(n, device=device)
    c = torch.full((n,), 2.0, device=device)

    def run() -> None:
        torch.add(b, c, alpha=3.0, out=a)

    run()
    return run


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


def op_bench_header(device: torch.device, rounds: int, quick: bool) -> tuple[dict[str, str],
                                                                           float]:
    """What a per-op bench prints first (machine, torch, date, the copy bandwidth its GB/s
    are read against, the rounds): returns the machine metadata and that bandwidth."""
    meta = machine(device)
    bw = copy_bandwidth_gbs(device, nbytes=1 << (22 if quick else 28))
    print(f"# {meta['device']} | torch {meta['torch']} | {meta['date']} | copy bandwidth "
          f"{bw:.1f} GB/s (read+write) | {rounds} interleaved rounds")
    return meta, bw


def op_bench_finish(rows: Sequence[dict[str, object]], cols: Sequence[str], op: str,
                    device: torch.device, meta: dict[str, str], tag: str, quick: bool,
                    out: str | None) -> None:
    """A per-op bench's table and CSV (bench_<op>_<device>_<date>[_tag][_quick].csv)."""
    print_table(rows, cols)
    name = f"bench_{op}_{device.type}_{meta['date']}"
    name += (f"_{tag}" if tag else "") + ("_quick" if quick else "")
    print(f"# wrote {write_csv(rows, name + '.csv', out)}")


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


# -- model-state bytes ------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor -> its shard


class StateBytes:
    """Bytes of unique tensor storages, attributed to the first kind that reaches them (a
    gradient that views a DDP bucket, or a master that views a flat partition, counts once)."""

    # Only these libraries' objects are entered: their attributes lead to optimizer state,
    # anything else (loggers, modules of the standard library) only to more of the same.
    WALKED = ("torch", "deepspeed", "zerokern")

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.out: dict[str, int] = {}

    def add(self, kind: str, t: torch.Tensor) -> None:
        st = _local(t).untyped_storage()
        key = st.data_ptr()
        if key == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.out[kind] = self.out.get(kind, 0) + st.nbytes()

    def walk(self, kind: str, obj: Any, depth: int = 6, _ids: set[int] | None = None) -> None:
        """Every tensor reachable from obj through containers and object attributes."""
        ids = set() if _ids is None else _ids
        if id(obj) in ids or depth < 0:
            return
        ids.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self.add(kind, obj)
            if obj.grad is not None:
                self.add(kind, obj.grad)
            return
        if isinstance(obj, nn.Module) or dist.is_available() and isinstance(obj, dist.ProcessGroup):
            return  # the model is counted as params/grads; process groups hold no state
        if isinstance(obj, dict):
            items = [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in self.WALKED:
            items = list(vars(obj).values())
        else:
            return
        for x in items:
            if isinstance(x, (str, bytes, int, float, bool, type(None))):
                continue
            self.walk(kind, x, depth - 1, ids)


def generic_state(model: nn.Module, *extra: Any) -> Callable[[], dict[str, int]]:
    """A function giving the params, grads and optim bytes this rank holds: the model's
    parameters, then their .grad, then whatever else is reachable from ``extra`` (optimizer,
    engine, master copies)."""

    def state() -> dict[str, int]:
        sb = StateBytes()
        params = list(model.parameters())
        for p in params:
            sb.add("params", p)
        for p in params:
            if p.grad is not None:
                sb.add("grads", p.grad)
        for obj in extra:
            sb.walk("optim", obj)
        return {k: sb.out.get(k, 0) for k in ("params", "grads", "optim")}

    return state


# -- collectives from the profiler ------------------------------------------------------------
# The names the profiler gives input dtypes (C++ spellings), for the element size.
_DTYPE_NAMES = {
    "float": torch.float32,
    "double": torch.float64,
    "c10::BFloat16": torch.bfloat16,
    "c10::Half": torch.float16,
    "long int": torch.int64,
    "int": torch.int32,
    "signed char": torch.int8,
    "unsigned char": torch.uint8,
    "bool": torch.bool,
    "BFloat16": torch.bfloat16,
    "Half": torch.float16,
}


def _event_bytes(e: Any, kind: str, world: int) -> int:
    """Bytes of one backend event as the ZeRO paper counts them, from its input shapes."""
    sizes = []
    for shape, dt in zip(e.input_shapes or [], getattr(e, "input_dtypes", None) or []):
        if isinstance(shape, list) and shape and all(isinstance(s, int) for s in shape):
            try:
                esz = torch.empty(0, dtype=_DTYPE_NAMES[dt]).element_size()
            except (TypeError, KeyError):
                continue
            sizes.append(math.prod(shape) * esz)
    if not sizes:
        return 0
    # all-reduce / broadcast: the tensor itself; reduce-scatter: the largest operand is the
    # full input; all-gather: the full output (gloo records only the shard).
    nbytes = max(sizes) * (2 if "all_reduce" in kind or "allreduce" in kind else 1)
    if "gather" in kind:
        nbytes = max(nbytes, world * min(sizes))
    return nbytes


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    busy, cur_s, cur_e = 0.0, 0.0, None
    for s, t in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy


def comm_from_profile(prof: Any, device: torch.device, steps: int, world: int) -> dict[str, Any]:
    """Per step: bytes (paper count) and union-of-intervals time of the process-group
    backend's collective events ("gloo:<kind>" / "nccl:<kind>"), and the bytes by kind."""
    by_kind: dict[str, float] = {}
    intervals: list[tuple[float, float]] = []
    for e in prof.events():
        backend, _, kind = e.name.partition(":")
        if backend not in ("gloo", "nccl") or not kind:
            continue
        by_kind[kind] = by_kind.get(kind, 0) + _event_bytes(e, kind, world)
        if device.type != "cuda":
            intervals.append((e.time_range.start, e.time_range.end))
    if device.type == "cuda":  # the NCCL kernels' own intervals on the device
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.name.lower().startswith(
                "nccl"
            ):
                intervals.append((e.time_range.start, e.time_range.end))
    out = {
        "comm_bytes": sum(by_kind.values()) / steps,
        "comm_ms": _union_us(intervals) / 1e3 / steps,
    }
    out["comm_kinds"] = ",".join(f"{k}:{v / steps / MB:.2f}MB" for k, v in sorted(by_kind.items()))
    return out
