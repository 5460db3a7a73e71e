"""Checkpoint benchmark: save/load times, and the peak memory of ``consolidate`` against the
size of the largest parameter.

A model of a few hundred MB of fp32 parameters with several large ones (embedding and head of
vocab x d_model, and 4 d_model x 4*d_model MLP pairs) is trained one step with ZeroAdamW (stage 2,
one plain process), saved, loaded back at stage 2 and at stage 0, then consolidated by a child
process (``python -m zerokern.cli.consolidate``) without and with ``--optimizer``. Peak memory is
the child's VmHWM (peak resident set of its own address space since exec, read from
/proc/self/status as it exits; ru_maxrss would also count the parent's pages that a vfork'ed
child inherits). Two more children give the scale: one that only imports what consolidate
imports (the constant), and a naive consolidation that loads every rank file with
safetensors.torch.load_file and writes the state dict with save_file.

    OMP_NUM_THREADS=2 python bench/bench_checkpoint.py --vocab 16384 --dim 1024 --blocks 6
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _harness import machine, print_table, write_csv

import zerokern
from zerokern.checkpoint import load_checkpoint, save_checkpoint

NAIVE = """
import json, os, sys, torch
from safetensors.torch import load_file, save_file
ck, out = sys.argv[1], sys.argv[2]
meta = json.load(open(os.path.join(ck, "meta.json")))
files = {f["name"]: load_file(os.path.join(ck, f["name"])) for f in meta["files"]}
parts = {}
for f in meta["files"]:
    for name, po, n, tensor, off in f["pieces"]:
        t = "master" if tensor == "state" else tensor
        parts.setdefault(name, []).append((po, files[f["name"]][t][off:off + n]))
sd = {n: torch.cat([t for _, t in sorted(v, key=lambda x: x[0])]).float()
      .view(meta["params"][n]["shape"]) for n, v in parts.items()}
save_file(sd, out)
"""
IMPORTS = "import torch, safetensors, zerokern.checkpoint, zerokern.cli.consolidate"
# Runs ``-m MODULE ARGS`` or ``-c CODE ARGS`` and writes its own VmHWM (bytes) to $ZK_HWM.
WRAP = """
import os, runpy, sys
try:
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        code, sys.argv = sys.argv[2], sys.argv[2:]
        exec(compile(code, "<bench>", "exec"), {"__name__": "__main__"})
finally:
    hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0]
    open(os.environ["ZK_HWM"], "w").write(str(int(hwm.split()[1]) * 1024))
"""


class Big(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, blocks: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim))
            for _ in range(blocks)
        )
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)


def build(args: argparse.Namespace, stage: int) -> tuple[Big, zerokern.ZeroAdamW]:
    torch.manual_seed(0)
    model = Big(args.vocab, args.dim, args.blocks)
    return model, zerokern.parallelize(model, stage=stage, lr=1e-3)


def child(args: list[str], hwm_file: Path) -> tuple[float, float]:
    """(seconds, peak resident MB) of ``python -m MODULE ...`` or ``python -c CODE ...``."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "ZK_HWM": str(hwm_file)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", WRAP, *args], env=env, check=True)
    return time.perf_counter() - t0, float(hwm_file.read_text()) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: tmp)")
    ap.add_argument("--out", default=None, help="CSV directory (default: the work directory)")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="zk_bench_ckpt_"))
    work.mkdir(parents=True, exist_ok=True)
    ck = str(work / "ck")
    model, opt = build(args, stage=2)
    psi = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters()) * 4 / 1e6
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad()
    rows = []
    t0 = time.perf_counter()
    save_checkpoint(ck, model, opt, extra={"step": 1})
    dt = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in Path(ck).iterdir()) / 1e6
    rows.append(
        {"what": "save_checkpoint (stage 2, 1 process)", "s": dt, "MB": size, "MB/s": size / dt}
    )
    del model, opt
    for stage in (2, 0):
        model, opt = build(args, stage=stage)
        t0 = time.perf_counter()
        load_checkpoint(ck, model, opt)
        dt = time.perf_counter() - t0
        rows.append(
            {
                "what": f"load_checkpoint (into stage {stage})",
                "s": dt,
                "MB": size,
                "MB/s": size / dt,
            }
        )
        del model, opt
    mods = ["-m", "zerokern.cli.consolidate", ck, str(work / "model.safetensors")]
    runs = [
        ("imports only (the constant)", ["-c", IMPORTS]),
        ("consolidate", mods),
        ("consolidate --optimizer", mods + ["--optimizer", str(work / "adamw.pt")]),
        ("naive: load_file all + save_file", ["-c", NAIVE, ck, str(work / "naive.st")]),
    ]
    const = None
    for what, cmd in runs:
        dt, rss = child(cmd, work / "hwm.txt")
        const = rss if const is None else const
        rows.append(
            {
                "what": what,
                "s": dt,
                "peak_rss_MB": rss,
                "above_imports_MB": rss - const,
                "above/largest": (rss - const) / largest,
            }
        )
    out_size = os.path.getsize(work / "model.safetensors") / 1e6
    info = machine(torch.device("cpu"))
    print(f"\n{info['device']}, torch {info['torch']}, {info['date']}")
    print(
        f"model: {psi / 1e6:.1f}M fp32 parameters = {psi * 4 / 1e6:.0f} MB "
        f"(consolidated file {out_size:.0f} MB), largest parameter {largest:.1f} MB, "
        f"checkpoint {size:.0f} MB\n"
    )
    print_table(
        rows, ["what", "s", "MB", "MB/s", "peak_rss_MB", "above_imports_MB", "above/largest"]
    )
    for r in rows:
        r.update(info, params=psi, largest_param_MB=largest)
    path = write_csv(rows, f"bench_checkpoint_{info['date']}.csv", args.out or work)
    print(f"\nCSV: {path}")
    if args.dir is None:
        shutil.rmtree(work / "ck", ignore_errors=True)


if __name__ == "__main__":
    main()
