"""Fused mixed-precision AdamW step: zerokern vs torch.optim.AdamW, side by side in one run.

    python bench/bench_adam.py                  # CPU here: 2^20..2^26 elements
    python bench/bench_adam.py --device cuda    # GPU: up to 2^28
    python bench/bench_adam.py --sizes 25 --quick

Every provider updates one flat shard of n parameters:
  torch_forloop / torch_foreach / torch_fused   torch.optim.AdamW on an fp32 param, fp32 grad
  torch_mixed    torch's mixed-precision pipeline doing our work: bf16 grad cast to fp32,
                 fused AdamW on the fp32 master, copy of the master into the bf16 param
  zk_<backend>   zerokern.ops.fused_adamw_ (bf16 grad, fp32 master/m/v, bf16 param written in
                 the same pass) for every backend available on the device
Bytes per element are counted as 28 for every row (read grad 2 + master, m, v 12; write
master, m, v 12 + bf16 param 2; the fp32-only AdamW rows move 4+12+12 = 28 as well), so GB/s
compares like with like; "% bw" is relative to a device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

from zerokern import ops  # noqa: E402
from zerokern.ops._backend import available_backends  # noqa: E402

BYTES_PER_ELEM = 28
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def torch_opt_step(n: int, device: torch.device, mode: str):
    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    kw = {"forloop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[
        mode
    ]
    opt = torch.optim.AdamW([p], **HP, **kw)
    return opt.step


def torch_mixed_step(n: int, device: torch.device):
    master = torch.nn.Parameter(torch.randn(n, device=device))
    p16 = master.detach().to(torch.bfloat16)
    g16 = torch.randn(n, device=device).to(torch.bfloat16)
    opt = torch.optim.AdamW([master], **HP, fused=True)

    def step():
        master.grad = g16.float()
        opt.step()
        p16.copy_(master.detach())

    return step


def zk_step(n: int, device: torch.device, backend: str):
    master = torch.randn(n, device=device)
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    g16 = torch.randn(n, device=device).to(torch.bfloat16)
    p16 = torch.empty(n, device=device, dtype=torch.bfloat16)
    state = {"step": 0}

    def step():
        state["step"] += 1
        ops.fused_adamw_(
            master,
            g16,
            m,
            v,
            lr=HP["lr"],
            beta1=HP["betas"][0],
            beta2=HP["betas"][1],
            eps=HP["eps"],
            weight_decay=HP["weight_decay"],
            step=state["step"],
            param_lp=p16,
            backend=backend,
        )

    return step


def providers(device: torch.device, quick: bool):
    out = {}
    for mode in ["fused"] if quick else ["forloop", "foreach", "fused"]:
        out[f"torch_{mode}"] = lambda n, d, mode=mode: torch_opt_step(n, d, mode)
    out["torch_mixed"] = torch_mixed_step
    for b in available_backends(device):
        if b == "torch" and quick:
            continue
        out[f"zk_{b}"] = lambda n, d, b=b: zk_step(n, d, b)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--sizes", type=int, nargs="+", help="log2 sizes (default 20..26 CPU, ..28 GPU)"
    )
    ap.add_argument("--quick", action="store_true", help="fewer providers and repeats")
    ap.add_argument("--out", help="folder for the CSV (default bench/results)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sizes = args.sizes or list(range(20, 29 if device.type == "cuda" else 27))
    meta = H.machine(device)
    bw = H.copy_bandwidth_gbs(device)
    print(
        f"# {meta['device']} | torch {meta['torch']} | {meta['date']} | copy bandwidth "
        f"{bw:.1f} GB/s (read+write)"
    )
    rows = []
    provs = providers(device, args.quick)
    for lg in sizes:
        n = 1 << lg
        base = None
        for name, make in provs.items():
            try:
                fn = make(n, device)
                t = H.time_fn(
                    fn,
                    device,
                    warmup=1 if args.quick else 2,
                    repeats=3 if args.quick else (5 if lg >= 24 else 15),
                )
            except torch.OutOfMemoryError:
                rows.append({"log2_n": lg, "provider": name, "status": "oom", **meta})
                continue
            gbs = n * BYTES_PER_ELEM / (t["ms"] * 1e-3) / 1e9
            row = {
                "log2_n": lg,
                "provider": name,
                "ms": t["ms"],
                "ms_min": t["ms_min"],
                "ms_max": t["ms_max"],
                "gparam_s": n / (t["ms"] * 1e-3) / 1e9,
                "gb_s": gbs,
                "pct_bw": 100 * gbs / bw,
                "status": "ok",
                "copy_bw_gbs": bw,
                **meta,
            }
            if name == "torch_mixed":
                base = t["ms"]
            rows.append(row)
            del fn
        for r in rows:
            if r["log2_n"] == lg and base and r.get("ms"):
                r["x_vs_torch_mixed"] = base / r["ms"]
    cols = ["log2_n", "provider", "ms", "gparam_s", "gb_s", "pct_bw", "x_vs_torch_mixed"]
    H.print_table(rows, cols)
    path = H.write_csv(rows, f"bench_adam_{device.type}_{meta['date']}.csv", args.out)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
