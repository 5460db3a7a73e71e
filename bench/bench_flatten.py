"""flatten_into_ / unflatten_from_ (a gradient bucket and back): zerokern vs torch, side by side.

    python bench/bench_flatten.py                  # CPU here: the three cases below, fp32 and bf16
    python bench/bench_flatten.py --device cuda
    python bench/bench_flatten.py --quick          # tiny cases, 3 rounds: a smoke test

Cases (tensor count x elements each, in the dtype of the row):
  many_small   2048 x 1024         (biases, norms: per-tensor overhead dominates)
  gpt_block    one GPT block of d_model 768, 12 tensors from 768 to 2.4M elements (7.1M)
  few_big      4 x 2^22            (bandwidth dominates)
Providers, flatten (every tensor into one flat buffer of the same dtype, packed in order):
  zk_<backend>         zerokern.ops.flatten_into_(tensors, flat, backend=...) for every backend
                       available on the device ("triton" on CPU only under TRITON_INTERPRET=1)
  torch_cat            torch.cat([t.reshape(-1) ...], out=flat). The baseline of "x_vs_base".
  torch_copy           flat's slices (views made once) .copy_(t) one by one: DDP's reducer
  torch_foreach_copy   torch._foreach_copy_(slices, tensors)
and unflatten (the flat buffer back into the tensors):
  zk_<backend>         zerokern.ops.unflatten_from_(flat, tensors, backend=...)
  torch_copy           t.view(-1).copy_(slice) one by one. The baseline.
  torch_foreach_copy   torch._foreach_copy_(tensors, slices)
The zerokern rows are the public op: its argument checks (in C++ for the cpu and cuda
backends, in Python for torch and triton) are part of what is timed. Every provider's result
is checked once, outside the timing. GB/s counts the
bytes read + written (2 x total); "% bw" is relative to a device copy measured in the same
run. The providers are timed in interleaved rounds (_harness.time_interleaved); "x_vs_base" is
the median over rounds of the baseline's time over the row's in the same round (> 1: faster
than the baseline), with its spread (min-max over rounds). bench_memory.py times the same op
on 4 GPT blocks. On a small shared CPU box run with OMP_NUM_THREADS=1 as well.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

from zerokern import ops  # noqa: E402
from zerokern.ops._backend import available_backends  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
D = 768
GPT_BLOCK = [(D,), (D,), (3 * D, D), (3 * D,), (D, D), (D,), (D,), (D,), (4 * D, D), (4 * D,),
             (D, 4 * D), (D,)]  # ln_1, qkv, proj, ln_2, mlp fc, mlp proj: weights and biases
CASES: dict[str, list[tuple[int, ...]]] = {
    "many_small": [(1024,)] * 2048,
    "gpt_block": GPT_BLOCK,
    "few_big": [(1 << 22,)] * 4,
}
QUICK_CASES: dict[str, list[tuple[int, ...]]] = {
    "many_small": [(256,)] * 64,
    "few_big": [(1 << 14,)] * 2,
}
BASE = {"flatten": "torch_cat", "unflatten": "torch_copy"}


Providers = dict[str, Callable[[], object]]


def flatten_providers(ts: list[torch.Tensor], flat: torch.Tensor) -> Providers:
    srcs = [t.view(-1) for t in ts]
    slots = list(flat.split([t.numel() for t in ts]))
    out: Providers = {}
    for b in available_backends(flat.device):
        out[f"zk_{b}"] = lambda b=b: ops.flatten_into_(ts, flat, backend=b)
    out["torch_cat"] = lambda: torch.cat([t.reshape(-1) for t in ts], out=flat)

    def torch_copy() -> None:
        for slot, src in zip(slots, srcs):
            slot.copy_(src)

    out["torch_copy"] = torch_copy
    out["torch_foreach_copy"] = lambda: torch._foreach_copy_(slots, srcs)
    return out


def unflatten_providers(flat: torch.Tensor, ts: list[torch.Tensor]) -> Providers:
    dsts = [t.view(-1) for t in ts]
    slots = list(flat.split([t.numel() for t in ts]))
    out: Providers = {}
    for b in available_backends(flat.device):
        out[f"zk_{b}"] = lambda b=b: ops.unflatten_from_(flat, ts, backend=b)

    def torch_copy() -> None:
        for dst, slot in zip(dsts, slots):
            dst.copy_(slot)

    out["torch_copy"] = torch_copy
    out["torch_foreach_copy"] = lambda: torch._foreach_copy_(dsts, slots)
    return out


def bench(device: torch.device, cases: dict[str, list[tuple[int, ...]]], dtypes: list[str],
          rounds: int, bw: float, meta: dict[str, str]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for dname in dtypes:
        dtype = DTYPES[dname]
        for case, shapes in cases.items():
            ts = [torch.randn(s, device=device, generator=gen).to(dtype) for s in shapes]
            numel = sum(t.numel() for t in ts)
            ref = torch.cat([t.reshape(-1) for t in ts])
            flat = torch.empty(numel, dtype=dtype, device=device)
            targets = [torch.empty_like(t) for t in ts]  # unflatten keeps the sources intact
            for direction, provs in (("flatten", flatten_providers(ts, flat)),
                                     ("unflatten", unflatten_providers(ref, targets))):
                for name, fn in provs.items():  # correctness once, outside the timing
                    if direction == "flatten":
                        flat.zero_()
                        fn()
                        assert torch.equal(flat, ref), f"{case} {dname} {name}: wrong flat buffer"
                    else:
                        for t in targets:
                            t.zero_()
                        fn()
                        assert all(torch.equal(a, b) for a, b in zip(ts, targets)), (
                            f"{case} {dname} {name}: wrong tensors")
                base = BASE[direction]
                times = H.compare_interleaved(provs, device, base, rounds=rounds)
                for name, t in times.items():
                    gbs = 2 * numel * flat.element_size() / (t["ms"] * 1e-3) / 1e9
                    rows.append({"direction": direction, "case": case, "dtype": dname,
                                 "tensors": len(ts), "numel": numel, "provider": name, **t,
                                 "gb_s": gbs, "pct_bw": 100 * gbs / bw, "baseline": base,
                                 "copy_bw_gbs": bw, **meta})
            del ts, ref, flat, targets
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), help="default: all")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 15; --quick: 3)")
    ap.add_argument("--quick", action="store_true", help="tiny cases, 3 rounds")
    ap.add_argument("--out", help="folder for the CSV (default bench/results)")
    ap.add_argument("--tag", default="", help="appended to the CSV name (e.g. t1)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    table = QUICK_CASES if args.quick else CASES
    cases = {k: v for k, v in table.items() if not args.cases or k in args.cases}
    rounds = args.rounds or (3 if args.quick else 15)
    meta, bw = H.op_bench_header(device, rounds, args.quick)
    rows = bench(device, cases, args.dtypes, rounds, bw, meta)
    cols = [
        "direction", "case", "dtype", "provider", "ms", "ms_min", "ms_max", "gb_s",
        "x_vs_base", "x_vs_base_min", "x_vs_base_max",
    ]
    H.op_bench_finish(rows, cols, "flatten", device, meta, args.tag, args.quick, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
