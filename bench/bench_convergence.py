"""Convergence of the compressed optimizer-state formats: the demo GPT trained from the same
weights on the same batches with each optimizer, loss curves and final losses side by side.

    python bench/bench_convergence.py                    # 2000 steps, the 7 default configs
    python bench/bench_convergence.py --steps 4000 --configs zk_fp32 zk_int8
    python bench/bench_convergence.py --quick            # tiny model, 12 steps: a smoke test

Model: zerokern.demo's GPT (character-level, vocab 32) at the size below, bf16 parameters and
compute, trained on zerokern.demo.data's batches (step s: get_batch(s, rank 0, world 1)). Every
config starts from torch.manual_seed(seed)'s weights and uses the same AdamW hyper-parameters
(lr 1e-3 peak, the demo's schedule: linear warm-up over 10% of the steps then cosine to lr/10;
betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every parameter, no clipping). Configs:
  zk_fp32             ZeroAdamW(stage=2) at world size 1: fp32 master and moments (exact AdamW)
  zk_bf16             ZeroAdamW(moments="bf16")
  zk_int8             ZeroAdamW(moments="int8"): 8-bit block-wise moments, fp32 master
  zk_int8_nomaster    ZeroAdamW(moments="int8", master="none"): no master, the bf16 params
                      updated with stochastic rounding
  zk_int8v3, zk_int8v3_nomaster  the same two with int8 format version 3
                      (zerokern.quant.fmt_v3, computed maps)
  torch_adamw         torch.optim.AdamW(fused) on fp32 master copies (bf16 grads copied in,
                      params copied out): the same math as zk_fp32 with other roundings, so
                      its distance to zk_fp32 is the noise floor of a "final loss" difference
  bnb_adamw8bit       bitsandbytes AdamW8bit on fp32 master copies, as torch_adamw
  torchao_adamw8bit   torchao AdamW8bit on fp32 master copies, as torch_adamw
  torchao_adamw8bit_sr  (not by default) torchao AdamW8bit(bf16_stochastic_round=True) on the
                      bf16 params themselves: torchao's master-free mode, beside zk_int8_nomaster
The zk configs run on the fastest zerokern backend that runs the compressed step here (all
backends give the same bits: the choice changes only the time; the CSV names it). A missing
optional provider (bitsandbytes, torchao) is skipped with its reason.

Output (bench/results/, or --out): bench_convergence_<device>_<date>[_tag]_curve.csv (every
step's training loss and lr per config), ..._summary.csv and .md (per config: "final loss",
the mean training loss of the last --tail steps (default 10% of the run); "eval loss", the
mean loss on --eval-batches fixed batches after training; "mean loss", over every step of
the run (how fast it got there); their difference to zk_fp32 in percent; the optimizer's
state bytes; ms per step), and ..._curve.png (moving average of the loss, when matplotlib is
installed). The goals of issue 27 are checked and printed: zk_int8's
final loss within 1% of zk_fp32's, and no worse than either 8-bit anchor's.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import bench_adam  # noqa: E402

import zerokern  # noqa: E402
from zerokern.demo.data import VOCAB, get_batch  # noqa: E402
from zerokern.demo.gpt import GPT, GPTConfig  # noqa: E402
from zerokern.demo.train import lr_at  # noqa: E402

HP = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MODEL = GPTConfig(n_layer=2, n_embd=128, n_head=4, vocab=VOCAB, seq=64)
QUICK_MODEL = GPTConfig(n_layer=1, n_embd=64, n_head=2, vocab=VOCAB, seq=16)
ZK = {  # config -> (moments, master)
    "zk_fp32": ("fp32", "fp32"),
    "zk_bf16": ("bf16", "fp32"),
    "zk_int8": ("int8", "fp32"),
    "zk_int8_nomaster": ("int8", "none"),
    "zk_int8v3": ("int8", "fp32"),
    "zk_int8v3_nomaster": ("int8", "none"),
}
# Configs created with int8 format version 3 (zerokern.quant.fmt_v3): ZeroAdamW(int8_format=3).
V3 = ("zk_int8v3", "zk_int8v3_nomaster")
OTHERS = ["torch_adamw", "bnb_adamw8bit", "torchao_adamw8bit", "torchao_adamw8bit_sr"]
CONFIGS = [*ZK, *OTHERS]
DEFAULT = [c for c in CONFIGS if c != "torchao_adamw8bit_sr"]
REF = "zk_fp32"
ANCHORS = ("bnb_adamw8bit", "torchao_adamw8bit")


class Skip(Exception):
    """An optional provider that cannot run here (its config is reported as skipped)."""


@dataclass
class Trainer:
    """One config's optimizer on a model: ``step()`` after backward, ``set_lr``, the bytes of
    optimizer state it holds (master copies included), and a description for the CSV."""

    step: Callable[[], None]
    set_lr: Callable[[float], None]
    state_bytes: Callable[[], int]
    what: str


def set_group_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """A float lr, or torchao's tensor lr filled in place (it refuses a float after compile)."""
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def tensor_bytes(*objs: Any) -> int:
    """Bytes of the distinct tensor storages in objs (tensors, or dicts and lists of them,
    such as ``opt.state``), gradients not counted; a tensor subclass (torchao's 8-bit state)
    counts the tensors it is made of."""
    seen: set[int] = set()

    def visit(x: Any) -> int:
        if isinstance(x, dict):
            return sum(visit(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(visit(v) for v in x)
        if not isinstance(x, torch.Tensor):
            return 0
        if type(x) not in (torch.Tensor, nn.Parameter) and hasattr(x, "__tensor_flatten__"):
            names, _ = x.__tensor_flatten__()
            return sum(visit(getattr(x, k)) for k in names)
        st = x.untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()

    return sum(visit(o) for o in objs)


def zk_trainer(model: nn.Module, name: str, lr: float, backend: str | None,
               seed: int) -> Trainer:
    moments, master = ZK[name]
    opt = zerokern.ZeroAdamW(model.parameters(), lr=lr, **HP, stage=2, moments=moments,
                             master=master, seed=seed, backend=backend,
                             int8_format=3 if name in V3 else 2)

    def state_bytes() -> int:
        s = opt.memory_stats()
        return sum(v for k, v in s.items() if k == "master" or k.startswith("exp_avg"))

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Trainer(step, lambda x: set_group_lr(opt, x), state_bytes,
                   f"ZeroAdamW(stage=2, moments={moments!r}, master={master!r}, "
                   f"backend={backend!r}, int8_format={opt.state_format.int8_format}), "
                   "world size 1")


class Masters:
    """fp32 master copies of bf16 params for torch-style optimizers: bf16 grads copied in,
    the optimizer steps the masters, the params copied back out (torch's mixed precision)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.masters = [nn.Parameter(p.detach().float()) for p in params]

    def wrap(self, opt: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            for m, p in zip(self.masters, self.params):
                m.grad = p.grad.float()
                p.grad = None
            opt.step()
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)

        return step


def other_trainer(model: nn.Module, name: str, lr: float) -> Trainer:
    params = list(model.parameters())
    if name == "torchao_adamw8bit_sr":  # on the bf16 params themselves
        opt = _torchao(params, lr, sr=True)

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Trainer(step, lambda x: set_group_lr(opt, x), lambda: tensor_bytes(opt.state),
                       f"{_version('torchao')} AdamW8bit(bf16_stochastic_round=True) on the "
                       "bf16 params")
    ms = Masters(params)
    if name == "torch_adamw":
        opt = torch.optim.AdamW(ms.masters, lr=lr, **HP, **_fused())
        what = f"torch.optim.AdamW({next(iter(_fused()))}=True) on fp32 masters"
    elif name == "bnb_adamw8bit":
        try:
            import bitsandbytes as bnb
        except Exception as exc:
            raise Skip(f"import bitsandbytes failed: {type(exc).__name__}: {exc}") from exc
        opt = bnb.optim.AdamW8bit(ms.masters, lr=lr, **HP)
        what = f"bitsandbytes {bnb.__version__} AdamW8bit on fp32 masters"
    elif name == "torchao_adamw8bit":
        opt = _torchao(ms.masters, lr, sr=False)
        what = f"{_version('torchao')} AdamW8bit on fp32 masters"
    else:
        raise ValueError(f"unknown config {name!r}")
    return Trainer(ms.wrap(opt), lambda x: set_group_lr(opt, x),
                   lambda: tensor_bytes(opt.state, ms.masters), what)


def _torchao(params: list[nn.Parameter], lr: float, sr: bool) -> torch.optim.Optimizer:
    try:
        from torchao.optim import AdamW8bit
    except Exception as exc:
        raise Skip(f"import torchao.optim failed: {type(exc).__name__}: {exc}") from exc
    return AdamW8bit(params, lr=lr, **HP, bf16_stochastic_round=sr)


def _version(mod: str) -> str:
    m = __import__(mod)
    return f"{mod} {getattr(m, '__version__', '?')}"


def _fused() -> dict[str, bool]:
    return {"fused": True} if bench_adam.fused_runs(torch.device("cpu")) else {"foreach": True}


def zk_backend(device: torch.device, requested: str | None) -> tuple[str, list[str]]:
    """The backend of the zk configs: ``requested``, else the fastest that runs both the
    fp32 and the compressed step here; and why the faster ones were passed over."""
    if requested:
        return requested, []
    ok8, why8 = bench_adam.working_backends("int8_nomaster", device)
    ok32, why32 = bench_adam.working_backends("fp32", device)
    both = [b for b in ok8 if b in ok32]
    notes = [f"zk backend {b} skipped: {w}" for b, w in {**why32, **why8}.items()]
    return both[0], notes


def evaluate(model: nn.Module, cfg: GPTConfig, batches: int, micro_batch: int) -> float:
    """Mean loss on fixed batches (steps 10^6 + i of the stream, never trained on as steps)."""
    with torch.no_grad():
        losses = []
        for i in range(batches):
            x, y = get_batch(1_000_000 + i, 0, 1, micro_batch, cfg.seq)
            _, loss = model(x, y)
            losses.append(loss.float().item())
    return statistics.fmean(losses)


def train(name: str, args: argparse.Namespace, cfg: GPTConfig,
          backend: str) -> dict[str, Any]:
    """One config from the seeded weights: every step's loss, the final and eval losses."""
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(torch.bfloat16)
    if name in ZK:
        tr = zk_trainer(model, name, args.lr, backend, args.seed)
    else:
        tr = other_trainer(model, name, args.lr)
    losses, lrs, times = [], [], []
    start = time.perf_counter()
    for s in range(args.steps):
        lr = lr_at(s, args.steps, args.lr)
        tr.set_lr(lr)
        x, y = get_batch(s, 0, 1, args.micro_batch, cfg.seq)
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        tr.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach().float().item())
        lrs.append(lr)
        if not math.isfinite(losses[-1]):
            break
        if args.progress and (s + 1) % args.progress == 0:
            print(f"#   {name} step {s + 1}: loss {losses[-1]:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    tail = args.tail or max(1, args.steps // 10)
    return {
        "config": name,
        "status": "ok" if len(losses) == args.steps else f"diverged at step {len(losses)}",
        "final_loss": statistics.fmean(losses[-tail:]),
        "tail_steps": tail,
        "eval_loss": evaluate(model, cfg, args.eval_batches, args.micro_batch),
        "first_loss": losses[0],
        "mean_loss": statistics.fmean(losses),  # the whole run: how fast it got there
        "min_loss": min(losses),
        "state_bytes": tr.state_bytes(),
        "step_ms": 1e3 * statistics.median(times),
        "train_s": time.perf_counter() - start,
        "what": tr.what,
        "losses": losses,
        "lrs": lrs,
    }


def add_relative(rows: list[dict[str, Any]]) -> None:
    """Each config's final and eval loss relative to zk_fp32's, in percent (+: worse)."""
    ref = next((r for r in rows if r["config"] == REF and "final_loss" in r), None)
    if ref is None:
        return
    for r in rows:
        if "final_loss" in r:
            r["final_vs_fp32_pct"] = 100 * (r["final_loss"] / ref["final_loss"] - 1)
            r["eval_vs_fp32_pct"] = 100 * (r["eval_loss"] / ref["eval_loss"] - 1)
            r["mean_vs_fp32_pct"] = 100 * (r["mean_loss"] / ref["mean_loss"] - 1)


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 27's convergence goals, each as a line: what was asked, the numbers, met or not.
    A difference to an anchor within the noise floor (torch_adamw's distance to zk_fp32, when
    it ran) is called so rather than a loss or a win."""
    by = {r["config"]: r for r in rows if "final_loss" in r}
    out = []
    noise = abs(by["torch_adamw"]["final_vs_fp32_pct"]) if "torch_adamw" in by else 0.0
    if "torch_adamw" in by and REF in by:
        out.append(f"noise floor: torch_adamw vs zk_fp32 (the same math, other roundings): "
                   f"{by['torch_adamw']['final_vs_fp32_pct']:+.3f}%")
    for cand in ("zk_int8", "zk_int8_nomaster", "zk_bf16"):
        if cand not in by or REF not in by:
            continue
        pct = by[cand]["final_vs_fp32_pct"]
        out.append(f"{cand} final loss {by[cand]['final_loss']:.4f} vs zk_fp32 "
                   f"{by[REF]['final_loss']:.4f}: {pct:+.3f}% -> within 1%: "
                   f"{'yes' if abs(pct) <= 1 else 'NO'}")
        # master-free rows also beside torchao's master-free mode, when it ran
        for a in ANCHORS + (("torchao_adamw8bit_sr",) if cand == "zk_int8_nomaster" else ()):
            if a not in by:
                continue
            d = 100 * (by[cand]["final_loss"] / by[a]["final_loss"] - 1)
            verdict = ("yes" if d <= 0 else f"yes, within the noise floor ({noise:.3f}%)"
                       if d <= noise else "NO")
            out.append(f"{cand} vs {a} ({by[a]['final_loss']:.4f}): {d:+.3f}% -> no worse: "
                       f"{verdict}")
    return out


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| config | final loss (mean of last steps) | vs zk_fp32 | eval loss "
             "| vs zk_fp32 | mean loss, all steps | vs zk_fp32 | state bytes | ms/step | what |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "final_loss" not in r:
            lines.append(f"| {r['config']} | {r['status']} | | | | | | | | |")
            continue
        lines.append(
            f"| {r['config']} | {r['final_loss']:.4f} | {r.get('final_vs_fp32_pct', 0):+.2f}% "
            f"| {r['eval_loss']:.4f} | {r.get('eval_vs_fp32_pct', 0):+.2f}% | "
            f"{r['mean_loss']:.4f} | {r.get('mean_vs_fp32_pct', 0):+.2f}% | "
            f"{r['state_bytes']:,} | {r['step_ms']:.1f} | {r['what']} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, window: int, title: str) -> bool:
    """Moving-average loss curves, one line per config (False without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    fig, (ax, axz) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in rows:
        if "losses" not in r:
            continue
        t = torch.tensor(r["losses"], dtype=torch.float64)
        w = max(1, min(window, len(t)))
        ma = t.unfold(0, w, 1).mean(1).tolist() if len(t) >= w else t.tolist()
        xs = list(range(w, w + len(ma)))
        for a in (ax, axz):
            a.plot(xs, ma, label=f"{r['config']} ({r['final_loss']:.4f})", lw=1)
    n = max(len(r.get("losses", [])) for r in rows)
    axz.set_xlim(n // 2, n)
    tail = [v for r in rows if "losses" in r for v in r["losses"][n // 2:]]
    if tail:
        lo, hi = min(tail), statistics.fmean(tail) + 2 * statistics.pstdev(tail)
        axz.set_ylim(lo - 0.05 * (hi - lo), hi)
    ax.set_title(f"training loss, moving average of {window} steps")
    axz.set_title("second half, zoomed")
    for a in (ax, axz):
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    ax.set_ylabel("loss")
    axz.legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_curve(rows: list[dict[str, Any]], path: Path) -> None:
    done = [r for r in rows if "losses" in r]
    n = max((len(r["losses"]) for r in done), default=0)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "lr", *(r["config"] for r in done)])
        for s in range(n):
            lr = next((r["lrs"][s] for r in done if s < len(r["lrs"])), "")
            w.writerow([s, lr, *(f"{r['losses'][s]:.5f}" if s < len(r["losses"]) else ""
                                 for r in done)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, help=f"default: {' '.join(DEFAULT)}")
    ap.add_argument("--steps", type=int, help="training steps (default 2000; --quick 12)")
    ap.add_argument("--micro-batch", type=int, help="sequences per step (default 16; --quick 4)")
    ap.add_argument("--n-layer", type=int, help=f"default {MODEL.n_layer}")
    ap.add_argument("--n-embd", type=int, help=f"default {MODEL.n_embd}")
    ap.add_argument("--n-head", type=int, help=f"default {MODEL.n_head}")
    ap.add_argument("--seq", type=int, help=f"default {MODEL.seq}")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    ap.add_argument("--seed", type=int, default=0, help="weights and stochastic rounding seed")
    ap.add_argument("--tail", type=int, help="steps averaged into the final loss (default 10%%)")
    ap.add_argument("--eval-batches", type=int, help="fixed eval batches (default 16; quick 2)")
    ap.add_argument("--backend", help="zerokern backend of the zk configs (default: the "
                    "fastest that runs the compressed step here)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--progress", type=int, default=0, help="print the loss every N steps")
    ap.add_argument("--quick", action="store_true", help="tiny model, 12 steps (smoke test)")
    ap.add_argument("--out", help="folder for the outputs (default bench/results)")
    ap.add_argument("--tag", default="", help="appended to the file names")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = QUICK_MODEL if args.quick else MODEL
    over = {k: getattr(args, k) for k in ("n_layer", "n_embd", "n_head", "seq")
            if getattr(args, k) is not None}
    cfg = replace(base, **over)
    args.steps = args.steps or (12 if args.quick else 2000)
    args.micro_batch = args.micro_batch or (4 if args.quick else 16)
    args.eval_batches = args.eval_batches or (2 if args.quick else 16)
    configs = args.configs or DEFAULT
    device = torch.device("cpu")
    backend, notes = zk_backend(device, args.backend)
    meta = H.machine(device)
    model = (f"demo GPT {cfg.n_layer}x{cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab}, "
             f"seq {cfg.seq}, {cfg.num_params() / 1e6:.3f}M params, bf16")
    print(f"# {meta['device']} | torch {meta['torch']} | {meta['date']} | {model} | "
          f"micro-batch {args.micro_batch}, {args.steps} steps, lr {args.lr}, seed "
          f"{args.seed} | zk backend {backend}")
    for note in notes:
        print(f"# {note}")
    rows: list[dict[str, Any]] = []
    for name in configs:
        try:
            r = train(name, args, cfg, backend)
        except Skip as exc:
            r = {"config": name, "status": f"skipped: {exc}"}
        print(f"# {name}: {r['status']}" + (
            f", final loss {r['final_loss']:.4f}, eval {r['eval_loss']:.4f}, "
            f"{r['step_ms']:.1f} ms/step, {r['train_s']:.0f} s" if "final_loss" in r else ""),
            flush=True)
        rows.append(r)
    add_relative(rows)
    command = "python bench/bench_convergence.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    header = (f"{meta['device']}, torch {meta['torch']}, {meta['date']}: {model}, micro-batch "
              f"{args.micro_batch}, {args.steps} steps, seed {args.seed}, zk backend "
              f"{backend}; final loss = mean training loss of the last "
              f"{args.tail or max(1, args.steps // 10)} steps.  \n`{command}`")
    summary = [{k: v for k, v in r.items() if k not in ("losses", "lrs")} for r in rows]
    for r in summary:
        r.update(model=model, micro_batch=args.micro_batch, steps=args.steps, seed=args.seed,
                 lr=args.lr, backend=backend, **meta)
    cols = ["config", "status", "final_loss", "final_vs_fp32_pct", "eval_loss",
            "eval_vs_fp32_pct", "mean_loss", "mean_vs_fp32_pct", "state_bytes", "step_ms",
            "train_s"]
    H.print_table(summary, cols)
    lines = goals(rows)
    for line in lines:
        print(f"# goal: {line}")
    md = markdown(rows, header) + "".join(f"\n- {x}" for x in lines)
    print("\n" + md)
    name = f"bench_convergence_{device.type}_{meta['date']}"
    name += (f"_{args.tag}" if args.tag else "") + ("_quick" if args.quick else "")
    path = H.write_csv(summary, f"{name}_summary.csv", args.out)
    path.with_suffix(".md").write_text(md + "\n")
    curve = path.parent / f"{name}_curve.csv"
    write_curve(rows, curve)
    png = path.parent / f"{name}_curve.png"
    drawn = plot(rows, png, max(1, args.steps // 40), header.split("  \n")[0])
    print(f"# wrote {path}, {path.with_suffix('.md').name}, {curve.name}"
          + (f", {png.name}" if drawn else " (no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
