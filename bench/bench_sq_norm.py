"""sq_norm, the gradient-norm pass: zerokern.ops.sq_norm vs torch's norms, side by side in one run.

    python bench/bench_sq_norm.py                  # CPU here: 2^16..2^24 elements, fp32 and bf16
    python bench/bench_sq_norm.py --device cuda    # GPU: up to 2^28
    python bench/bench_sq_norm.py --quick          # 2 small sizes, 3 rounds: a smoke test

Every provider returns the fp32 sum of squares of one flat tensor x of n elements (a gradient
shard) in the dtype of the row:
  zk_<backend>        zerokern.ops.sq_norm(x, backend=...) for every backend available on the
                      device ("triton" on CPU only under TRITON_INTERPRET=1)
  torch_vector_norm   torch.linalg.vector_norm(x, dtype=torch.float32) ** 2: torch's reduction,
                      accumulating in fp32 without an upcast copy. The baseline of "x_vs_base".
  torch_float_norm    torch.linalg.vector_norm(x.float()) ** 2: what a port writes; in bf16 it
                      first makes an fp32 copy of x
  torch_foreach_norm  torch._foreach_norm([x], 2, dtype=torch.float32)[0] ** 2: the multi-tensor
                      kernel of torch.nn.utils.clip_grad_norm_
Each provider's result is compared with a float64 sum once, outside the timing ("rel_err";
more than 1e-2 off fails the run). GB/s counts the bytes read (n x element size); "% bw" is
relative to a device copy measured in the same run. The providers are timed in interleaved
rounds (_harness.time_interleaved: every provider once per round, so that a drift of a shared
machine hits all alike); "x_vs_base" is the median over rounds of the baseline's time over the
row's in the same round (> 1: faster than torch), with its spread (min-max over rounds). On a
small shared CPU box run with OMP_NUM_THREADS=1 as well (bench/README.md, bench_memory.py:
2-thread OpenMP regions stall when a thread is descheduled).
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

BASE = "torch_vector_norm"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def providers(x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for b in available_backends(x.device):
        out[f"zk_{b}"] = lambda b=b: ops.sq_norm(x, backend=b)
    out[BASE] = lambda: torch.linalg.vector_norm(x, dtype=torch.float32).square()
    out["torch_float_norm"] = lambda: torch.linalg.vector_norm(x.float()).square()
    out["torch_foreach_norm"] = lambda: torch._foreach_norm([x], 2, dtype=torch.float32)[
        0
    ].square()
    return out


def rel_err(name: str, got: torch.Tensor, want: float) -> float:
    """|got - want| / want against a float64 sum, checked to be under 1e-2: the same quantity
    (not the norm, not a partial sum). Not a numerics test (tests/test_ops_sq_norm.py is):
    fp32 accumulators of n positive terms drift by up to about (n / lanes) * 2^-24 relative, and
    torch's own vector_norm(dtype=float32) is 1.3e-3 off at 2^24 elements on one CPU thread;
    the CSV records each provider's error."""
    assert got.dtype == torch.float32 and got.dim() == 0, f"{name}: {got.dtype} {got.shape}"
    err = abs(got.item() - want) / want
    assert err < 1e-2, f"{name}: {got.item()} vs {want} (float64)"
    return err


def bench(device: torch.device, sizes: list[int], dtypes: list[str], rounds: int, bw: float,
          meta: dict[str, str]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for dname in dtypes:
        dtype = DTYPES[dname]
        for lg in sizes:
            n = 1 << lg
            x = torch.randn(n, device=device, generator=gen).to(dtype)
            provs = providers(x)
            want = x.double().square().sum().item()
            errs = {name: rel_err(name, fn(), want) for name, fn in provs.items()}
            times = H.compare_interleaved(provs, device, BASE, rounds=rounds)
            for name, t in times.items():
                gbs = n * x.element_size() / (t["ms"] * 1e-3) / 1e9
                rows.append({"dtype": dname, "log2_n": lg, "provider": name, **t, "gb_s": gbs,
                             "pct_bw": 100 * gbs / bw, "rel_err": errs[name], "baseline": BASE,
                             "copy_bw_gbs": bw, **meta})
            del x, provs
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", type=int, nargs="+",
                    help="log2 sizes (default 16 18 20 22 24 on CPU, 16..28 step 2 on GPU)")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 15; --quick: 3)")
    ap.add_argument("--quick", action="store_true", help="2 small sizes, 3 rounds")
    ap.add_argument("--out", help="folder for the CSV (default bench/results)")
    ap.add_argument("--tag", default="", help="appended to the CSV name (e.g. t1)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    top = 29 if device.type == "cuda" else 25
    sizes = args.sizes or ([10, 14] if args.quick else list(range(16, top, 2)))
    rounds = args.rounds or (3 if args.quick else 15)
    meta, bw = H.op_bench_header(device, rounds, args.quick)
    rows = bench(device, sizes, args.dtypes, rounds, bw, meta)
    cols = [
        "dtype", "log2_n", "provider", "ms", "ms_min", "ms_max", "gb_s",
        "x_vs_base", "x_vs_base_min", "x_vs_base_max", "rel_err",
    ]
    H.op_bench_finish(rows, cols, "sq_norm", device, meta, args.tag, args.quick, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
