"""Memory: gradient-bucket flatten throughput and the ZeRO-R fragmentation scenario (§6.3).

    python bench/bench_memory.py                  # CPU here: 4 GPT blocks, 256 MiB budget
    python bench/bench_memory.py --device cuda    # GPU: same list, 2 GiB budget
    python bench/bench_memory.py --quick          # 1 block, 64 MiB budget, fewer repeats

Part 1, flatten. The gradient list is the parameters of 4 GPT blocks with d_model 768, in
module order and nn.Linear (out, in) shapes, 12 tensors per block: LayerNorm weight + bias,
qkv 2304x768 + bias, attention proj 768x768 + bias, LayerNorm weight + bias, MLP 3072x768 +
bias and 768x3072 + bias (7,087,872 elements per block; 4 blocks = 48 tensors, 113 MB in
fp32, 57 MB in bf16). Providers, each filling one flat buffer of the same dtype:
  zk_<backend>          zerokern.ops.flatten_into_ for every backend available on the device
                        ("triton" on CPU only under TRITON_INTERPRET=1)
  torch_cat             torch.cat([t.reshape(-1) ...], out=flat)
  torch_flatten_dense   torch._utils._flatten_dense_tensors(tensors) (allocates its output)
and the reverse direction:
  zk_<backend>          zerokern.ops.unflatten_from_
  torch_unflatten_copy  torch._utils._unflatten_dense_tensors + copy_ into each tensor
GB/s counts bytes read + written = 2 x total bytes for every row; "x_vs_base" is the baseline's
median time over the row's (torch_cat for flatten, torch_unflatten_copy for unflatten; > 1 is
faster than the baseline); "% bw" is relative to a device copy measured in the same run.
Providers are timed in turns, one call each per round (15 rounds, 5 with --quick), so that load
from other processes on a shared machine falls on all of them alike; ms is the median, ms_min
the fastest round. On a small shared CPU box 2-thread OpenMP regions suffer badly from
oversubscription: compare OMP_NUM_THREADS=1 runs as well.

Part 2, fragmentation. A forward pass of L = 16 layers on a budget of B bytes: each layer
allocates a short-lived activation block and then a long-lived activation checkpoint (bf16,
4:1 in size, together 90% of B), and the activations are freed at the end of the forward.
The free memory is then many activation-sized holes between checkpoints plus the tail. The
benchmark finds the largest single allocation that still succeeds (binary search; it stands
for the contiguous gradient bucket or recompute buffer that backward asks for next) for
  arena            zerokern.memory.Arena of B bytes, as left by the forward
  arena+defrag     the same arena after Arena.defragment() (bytes moved and time reported)
  first_fit_model  (CPU) offsets-only model of an allocator that never moves blocks: first
                   fit in address order, neighbours coalesced on free; stands in for a
                   caching allocator
  torch_caching    (CUDA, instead of the model) torch's caching allocator under
                   torch.cuda.set_per_process_memory_fraction(B + reserved before)
                   running the same pattern with torch.empty from a cold cache
  torch_caching_warm  (CUDA) the same after one freed 0.9 B tensor was left cached, so the
                   forward's blocks are split out of one segment that the checkpoints pin
Checkpoint contents are checked after every defragment (the benchmark fails otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

from zerokern import ops  # noqa: E402
from zerokern.memory import Arena, ArenaOutOfMemory  # noqa: E402
from zerokern.ops._backend import available_backends  # noqa: E402

MiB = 1 << 20
D_MODEL = 768
LAYERS = 16
ALIGN = 256  # Arena default alignment; the first-fit model uses the same


# -- part 1: flatten ------------------------------------------------------------------------


def gpt_block_shapes(d: int = D_MODEL) -> list[tuple[int, ...]]:
    """Parameter (= gradient) shapes of one GPT block in module order."""
    return [
        (d,), (d,),  # ln_1 weight, bias
        (3 * d, d), (3 * d,),  # attn qkv
        (d, d), (d,),  # attn proj
        (d,), (d,),  # ln_2 weight, bias
        (4 * d, d), (4 * d,),  # mlp fc
        (d, 4 * d), (d,),  # mlp proj
    ]  # fmt: skip


def gradient_list(blocks: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for _ in range(blocks):
        for shape in gpt_block_shapes():
            t = torch.empty(shape, dtype=dtype, device=device)
            out.append(t.normal_(generator=g))
    return out


def zk_backends(device: torch.device) -> list[str]:
    interpreting = os.environ.get("TRITON_INTERPRET", "") == "1"
    return [
        b
        for b in available_backends(device)
        if not (b == "triton" and device.type == "cpu" and not interpreting)
    ]


def flatten_providers(grads, flat, device) -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {}
    for b in zk_backends(device):
        out[f"zk_{b}"] = lambda b=b: ops.flatten_into_(grads, flat, backend=b)
    out["torch_cat"] = lambda: torch.cat([t.reshape(-1) for t in grads], out=flat)
    out["torch_flatten_dense"] = lambda: _flatten_dense_tensors(grads)
    return out


def unflatten_providers(flat, grads, device) -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {}
    for b in zk_backends(device):
        out[f"zk_{b}"] = lambda b=b: ops.unflatten_from_(flat, grads, backend=b)

    def torch_unflatten_copy() -> None:
        for t, v in zip(grads, _unflatten_dense_tensors(flat, grads)):
            t.copy_(v)

    out["torch_unflatten_copy"] = torch_unflatten_copy
    return out


def time_interleaved(
    fns: dict[str, Callable[[], object]], device: torch.device, warmup: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Median/min/max ms per provider, timing them in turns (one call each per round) so that
    load from other processes on a shared machine falls on all providers alike."""
    for fn in fns.values():
        H.time_fn(fn, device, warmup=warmup, repeats=1)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(H.time_fn(fn, device, warmup=0, repeats=1)["ms"])
    return {
        k: {"ms": statistics.median(v), "ms_min": min(v), "ms_max": max(v), "repeats": len(v)}
        for k, v in samples.items()
    }


def bench_flatten(device, blocks, warmup, rounds, bw, meta) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for dtype in (torch.float32, torch.bfloat16):
        grads = gradient_list(blocks, dtype, device)
        numel = sum(t.numel() for t in grads)
        nbytes = numel * dtype.itemsize
        ref = torch.cat([t.reshape(-1) for t in grads])
        flat = torch.empty(numel, dtype=dtype, device=device)
        common = {
            "dtype": str(dtype).removeprefix("torch."),
            "tensors": len(grads),
            "numel": numel,
            "total_bytes": nbytes,
        }
        # Reverse direction writes into separate targets so the source list stays intact.
        targets = [torch.empty_like(t) for t in grads]
        for direction, provs, base in (
            ("flatten", flatten_providers(grads, flat, device), "torch_cat"),
            ("unflatten", unflatten_providers(ref, targets, device), "torch_unflatten_copy"),
        ):
            for name, fn in provs.items():  # correctness once, outside the timing
                if direction == "flatten":
                    flat.fill_(0)
                    res = fn()
                    got = res if name == "torch_flatten_dense" else flat
                    assert torch.equal(got, ref), f"{name} {dtype}: wrong flat buffer"
                else:
                    for t in targets:
                        t.fill_(0)
                    fn()
                    assert all(torch.equal(a, b) for a, b in zip(grads, targets)), name
            times = time_interleaved(provs, device, warmup, rounds)
            for name, t in times.items():
                gbs = 2 * nbytes / (t["ms"] * 1e-3) / 1e9
                rows.append(
                    {
                        "direction": direction,
                        **common,
                        "provider": name,
                        **t,
                        "gb_s": gbs,
                        "pct_bw": 100 * gbs / bw,
                        "baseline": base,
                        "x_vs_base": times[base]["ms"] / t["ms"],
                        "copy_bw_gbs": bw,
                        **meta,
                    }
                )
        del grads, ref, flat, targets
    return rows


# -- part 2: fragmentation ------------------------------------------------------------------


class FirstFitModel:
    """Offsets only: first fit in address order, free runs coalesced, blocks never move."""

    def __init__(self, capacity: int, alignment: int = ALIGN) -> None:
        self.capacity, self.alignment = capacity, alignment
        self.free_runs: list[list[int]] = [[0, capacity]]  # [offset, size], by offset
        self.live: dict[int, int] = {}

    def _reserved(self, nbytes: int) -> int:
        a = self.alignment
        return max(-(-nbytes // a) * a, a)

    def alloc(self, nbytes: int) -> int:
        need = self._reserved(nbytes)
        for i, (off, size) in enumerate(self.free_runs):
            if size >= need:
                if size == need:
                    del self.free_runs[i]
                else:
                    self.free_runs[i] = [off + need, size - need]
                self.live[off] = need
                return off
        raise MemoryError(f"first-fit model: no free run of {need} bytes")

    def free(self, offset: int) -> None:
        size = self.live.pop(offset)
        runs = self.free_runs
        i = 0
        while i < len(runs) and runs[i][0] < offset:
            i += 1
        runs.insert(i, [offset, size])
        if i + 1 < len(runs) and offset + size == runs[i + 1][0]:  # merge with the next run
            runs[i][1] += runs.pop(i + 1)[1]
        if i > 0 and runs[i - 1][0] + runs[i - 1][1] == offset:  # and with the previous one
            runs[i - 1][1] += runs.pop(i)[1]

    def stats(self) -> dict[str, float]:
        free = self.capacity - sum(self.live.values())
        largest = max((s for _, s in self.free_runs), default=0)
        return {
            "in_use": self.capacity - free,
            "free_bytes": free,
            "largest_free": largest,
            "live_blocks": len(self.live),
            "fragmentation": 0.0 if free == 0 else 1.0 - largest / free,
        }


def scenario(budget: int) -> tuple[int, int]:
    """(activation numel, checkpoint numel) in bf16: 4:1, L layers filling 90% of budget."""
    per_layer = int(0.9 * budget) // LAYERS
    act_bytes = (per_layer * 4 // 5) // ALIGN * ALIGN
    ckpt_bytes = (per_layer // 5) // ALIGN * ALIGN
    return act_bytes // 2, ckpt_bytes // 2


def max_alloc(try_alloc: Callable[[int], bool], limit: int, step: int) -> int:
    """Largest multiple of `step` in [0, limit] for which try_alloc succeeds (0 assumed to)."""
    lo, hi = 0, limit // step
    if try_alloc(hi * step):
        return hi * step
    while hi - lo > 1:  # invariant: lo succeeds, hi fails
        mid = (lo + hi) // 2
        if try_alloc(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step


def ckpt_pattern(i: int, numel: int, device: torch.device, out=None) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(1000 + i)
    if out is None:
        out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    return out.normal_(generator=g)


def arena_try(arena: Arena) -> Callable[[int], bool]:
    def attempt(nbytes: int) -> bool:
        try:
            b = arena.alloc(nbytes, torch.uint8)
        except ArenaOutOfMemory:
            return False
        arena.free(b)
        return True

    return attempt


def arena_run(device, budget, act_n, ckpt_n) -> dict[str, object]:
    """One forward on a fresh arena, probed before and after defragment()."""
    arena = Arena(budget, device, alignment=ALIGN)
    acts, ckpts = [], []
    for i in range(LAYERS):
        acts.append(arena.alloc(act_n, torch.bfloat16))
        acts[-1].tensor.fill_(7.0)
        ckpts.append(arena.alloc(ckpt_n, torch.bfloat16))
        ckpt_pattern(i, ckpt_n, device, out=ckpts[-1].tensor)
    for a in acts:
        arena.free(a)
    before = arena.stats()
    largest_before = max_alloc(arena_try(arena), budget, ALIGN)
    assert largest_before == before["largest_free"], (largest_before, before)
    H.sync(device)
    t0 = time.perf_counter()
    moved = arena.defragment()
    H.sync(device)
    defrag_ms = (time.perf_counter() - t0) * 1e3
    after = arena.stats()
    largest_after = max_alloc(arena_try(arena), budget, ALIGN)
    assert largest_after == after["free_bytes"] == after["largest_free"], (largest_after, after)
    for i, c in enumerate(ckpts):  # the checkpoints survived the move
        assert torch.equal(c.tensor, ckpt_pattern(i, ckpt_n, device)), f"checkpoint {i} corrupted"
    return {
        "before": before,
        "after": after,
        "largest_before": largest_before,
        "largest_after": largest_after,
        "moved": moved,
        "defrag_ms": defrag_ms,
    }


def first_fit_run(budget, act_n, ckpt_n) -> dict[str, object]:
    m = FirstFitModel(budget)
    acts, ckpts = [], []
    for _ in range(LAYERS):
        acts.append(m.alloc(act_n * 2))
        ckpts.append(m.alloc(ckpt_n * 2))
    for a in acts:
        m.free(a)

    def attempt(nbytes: int) -> bool:
        try:
            off = m.alloc(nbytes)
        except MemoryError:
            return False
        m.free(off)
        return True

    st = m.stats()
    largest = max_alloc(attempt, budget, ALIGN)
    assert largest == st["largest_free"], (largest, st)
    return {"stats": st, "largest": largest}


def caching_run(device, budget, act_n, ckpt_n, warm: bool) -> dict[str, object]:
    """The same forward with torch.empty under a per-process memory fraction (CUDA only).

    The fraction caps the bytes the caching allocator reserves, not an address range; the
    allocator rounds requests (2 MiB above 10 MiB, 20 MiB segments for 1-10 MiB), so the forward
    itself can fail where the arena's fits: that is reported as the row's status.
    """
    step = 2 * MiB
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (base + budget) / total), device)
    acts: list[torch.Tensor] = []
    ckpts: list[torch.Tensor] = []
    out: dict[str, object] = {"status": "ok", "live": None, "reserved": None, "largest": None}
    try:
        if warm:  # an earlier tensor of 0.9 B, freed but still cached as one segment
            big = torch.empty(int(0.9 * budget), dtype=torch.uint8, device=device)
            del big
        alloc0 = torch.cuda.memory_allocated(device)
        for i in range(LAYERS):
            try:
                acts.append(torch.empty(act_n, dtype=torch.bfloat16, device=device).fill_(7.0))
                ckpts.append(ckpt_pattern(i, ckpt_n, device))
            except torch.OutOfMemoryError:
                out["status"] = f"oom in forward at layer {i}"
                break
        acts.clear()
        torch.cuda.synchronize(device)
        out["live"] = torch.cuda.memory_allocated(device) - alloc0
        out["reserved"] = torch.cuda.memory_reserved(device) - base

        def attempt(nbytes: int) -> bool:
            try:
                t = torch.empty(nbytes, dtype=torch.uint8, device=device)
            except torch.OutOfMemoryError:
                return False
            del t
            return True

        if out["status"] == "ok":
            out["largest"] = max_alloc(attempt, budget, step)
    finally:
        acts.clear()
        ckpts.clear()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    return out


def bench_fragmentation(device, budget, reps, meta) -> list[dict[str, object]]:
    act_n, ckpt_n = scenario(budget)
    runs = [arena_run(device, budget, act_n, ckpt_n) for _ in range(reps)]
    r0 = runs[0]
    for r in runs[1:]:  # deterministic bookkeeping: every repeat must agree
        assert r["before"] == r0["before"] and r["moved"] == r0["moved"]
    defrag_ms = statistics.median(r["defrag_ms"] for r in runs)
    common = {
        "budget_bytes": budget,
        "layers": LAYERS,
        "act_bytes": act_n * 2,
        "ckpt_bytes": ckpt_n * 2,
    }

    def row(allocator, st, largest, **extra) -> dict[str, object]:
        free = st.get("free_bytes")
        return {
            "allocator": allocator,
            **common,
            "live_bytes": st.get("in_use"),
            "free_bytes": free,
            "largest_free_bytes": st.get("largest_free"),
            "fragmentation": st.get("fragmentation"),
            "max_alloc_bytes": largest,
            "max_alloc_pct_free": 100 * largest / free if free and largest is not None else None,
            "status": "ok",
            **extra,
        }

    rows = [
        row("arena", r0["before"], r0["largest_before"]),
        row(
            "arena+defrag",
            r0["after"],
            r0["largest_after"],
            moved_bytes=r0["moved"],
            defrag_ms=defrag_ms,
            defrag_ms_min=min(r["defrag_ms"] for r in runs),
            defrag_ms_max=max(r["defrag_ms"] for r in runs),
            defrag_repeats=reps,
            defrag_gb_s=2 * r0["moved"] / (defrag_ms * 1e-3) / 1e9,
        ),
    ]
    if device.type == "cuda":
        for warm in (False, True):
            c = caching_run(device, budget, act_n, ckpt_n, warm)
            st = {"in_use": c["live"], "free_bytes": budget - c["live"]}
            name = "torch_caching_warm" if warm else "torch_caching"
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
            extra = {"reserved_bytes": c["reserved"], "alloc_conf": conf, "status": c["status"]}
            rows.append(row(name, st, c["largest"], **extra))
    else:
        f = first_fit_run(budget, act_n, ckpt_n)
        rows.append(row("first_fit_model", f["stats"], f["largest"]))
    for r in rows:
        r.update(meta)
    return rows


# -- CLI ------------------------------------------------------------------------------------


def mib_view(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    out = []
    for r in rows:
        v = dict(r)
        for k in ("live", "free", "largest_free", "max_alloc", "moved"):
            b = r.get(f"{k}_bytes")
            v[f"{k}_mib"] = b / MiB if isinstance(b, int) else ""
        frag = r.get("fragmentation")
        v["frag_pct"] = 100 * frag if isinstance(frag, float) else ""
        out.append(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="1 block, smaller budget, fewer repeats")
    ap.add_argument("--out", help="folder for the CSVs (default bench/results)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    blocks = 1 if args.quick else 4
    warmup, rounds = (1, 5) if args.quick else (2, 15)
    budget = (512 if cuda else 64) * MiB if args.quick else (2048 if cuda else 256) * MiB
    meta = H.machine(device)
    bw = H.copy_bandwidth_gbs(device, nbytes=(64 if args.quick else 256) * MiB)
    print(
        f"# {meta['device']} | torch {meta['torch']} | {meta['date']} | copy bandwidth "
        f"{bw:.1f} GB/s (read+write)"
    )

    print(f"\n## flatten: {blocks} GPT block(s), d_model {D_MODEL}, into one flat buffer")
    rows = bench_flatten(device, blocks, warmup, rounds, bw, meta)
    H.print_table(
        rows,
        [
            "direction",
            "dtype",
            "total_bytes",
            "provider",
            "ms",
            "ms_min",
            "gb_s",
            "pct_bw",
            "x_vs_base",
        ],
    )
    path = H.write_csv(rows, f"bench_flatten_{device.type}_{meta['date']}.csv", args.out)
    print(f"# wrote {path}")

    print(f"\n## fragmentation: {LAYERS} layers, budget {budget // MiB} MiB")
    frows = bench_fragmentation(device, budget, 1 if args.quick else 5, meta)
    H.print_table(
        mib_view(frows),
        [
            "allocator",
            "live_mib",
            "free_mib",
            "largest_free_mib",
            "frag_pct",
            "max_alloc_mib",
            "max_alloc_pct_free",
            "moved_mib",
            "defrag_ms",
        ]
        + (["status"] if cuda else []),
    )
    path = H.write_csv(frows, f"bench_fragmentation_{device.type}_{meta['date']}.csv", args.out)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
