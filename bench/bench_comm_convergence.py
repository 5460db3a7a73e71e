"""Convergence of quantized communication (issue 38): the demo GPT trained on 2 gloo ranks under
ZeRO stage 3, once per communication config, losses side by side.

    python bench/bench_comm_convergence.py --steps 2000 --tag issue38    # every config
    python bench/bench_comm_convergence.py --configs g8 --steps 500       # one config
    python bench/bench_comm_convergence.py --report --steps 2000 --tag issue38  # tables + plot
    python bench/bench_comm_convergence.py --quick                         # smoke test

Model and optimizer as bench/bench_convergence.py (its GPTConfig, AdamW hyper-parameters and
lr schedule), bf16 parameters and compute, here ``zerokern.parallelize(stage=3,
unit_classes=(Block,))`` on 2 ranks: rank r trains on ``get_batch(step, r, 2, micro_batch)``,
the loss of a step is the mean over both ranks. Configs (ZeroAdamW's options):
  base        16-bit communication (bf16 gathers and reduce-scatters), seed --seed
  base_s1     the same with seed --seed + 1: its distance to ``base`` is the noise floor
  g8          gather_dtype="int8"   (ZeRO++ qwZ: the parameter all-gathers in int8 codes)
  r8          reduce_dtype="int8"   (ZeRO++ qgZ-style: the gradient reduce-scatter in int8)
  r4          reduce_dtype="int4"
  g8r8        gather_dtype="int8", reduce_dtype="int8"
  r4ef        reduce_dtype="int4", error_feedback=True
  r8ef        reduce_dtype="int8", error_feedback=True
``--fp32-linear`` computes the bf16 linears and attention in fp32 from the same bf16 inputs,
rounded once to bf16 (a CPU without AVX-512 BF16 runs torch's bf16 GEMM ~10x slower than
fp32); the issue-38 runs of 2026-12-05 ``_issue38b*`` used it for every config.
Each config is its own 2-rank launch whose rank 0 writes ``<out>/<name>_<config>.json``
(every step's loss, eval loss, ms/step, comm_stats() bytes), so a long series can run in the
background and be reported (``--report``: summary .md/.csv and the curve .png) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import bench_convergence as BC  # noqa: E402

import zerokern  # noqa: E402
from zerokern.demo.data import get_batch  # noqa: E402
from zerokern.demo.gpt import GPT, Block, GPTConfig  # noqa: E402
from zerokern.demo.train import lr_at  # noqa: E402

CONFIGS: dict[str, tuple[dict[str, Any], int]] = {  # name -> (ZeroAdamW options, seed offset)
    "base": ({}, 0),
    "base_s1": ({}, 1),
    "g8": ({"gather_dtype": "int8"}, 0),
    "r8": ({"reduce_dtype": "int8"}, 0),
    "r4": ({"reduce_dtype": "int4"}, 0),
    "g8r8": ({"gather_dtype": "int8", "reduce_dtype": "int8"}, 0),
    # error feedback (comm/quantized_parts.py): the quantization residual is added back into
    # the next step's gradient, so the rounding error does not accumulate in the weights
    "r4ef": ({"reduce_dtype": "int4", "error_feedback": True}, 0),
    "r8ef": ({"reduce_dtype": "int8", "error_feedback": True}, 0),
}
REF, NOISE = "base", "base_s1"
GOALS = {"g8": 0.5, "r8": 0.5, "g8r8": 0.5, "r4": 1.0,  # |final loss vs base| in %
         "r4ef": 1.0, "r8ef": 0.5}
WORLD = 2


def _rank(rank: int, port: int, cfg: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        res = _train(rank, cfg)
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


class _Fp32Linear(torch.overrides.TorchFunctionMode):
    """``--fp32-linear``: every bf16 ``F.linear`` and attention (forward and, through autograd,
    backward) computed from the same bf16 inputs in fp32 and rounded once to bf16. The CPU's
    bf16 GEMM without AVX-512 BF16 runs ~10x slower than fp32 and dominated the step; this one
    also accumulates in fp32, only in another order (results differ in the last bf16 bit)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and args[0].dtype == torch.bfloat16:
            x, w, b = (list(args) + [kwargs.get("bias")])[:3]
            y = func(x.float(), w.float(), None if b is None else b.float())
            return y.to(torch.bfloat16)
        if (func is torch.nn.functional.scaled_dot_product_attention
                and args[0].dtype == torch.bfloat16):
            return func(*(a.float() if isinstance(a, torch.Tensor) else a for a in args),
                        **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def _train(rank: int, c: dict[str, Any]) -> dict[str, Any]:
    if c.get("fp32_linear"):
        with _Fp32Linear():
            return _train_loop(rank, c)
    return _train_loop(rank, c)


def _train_loop(rank: int, c: dict[str, Any]) -> dict[str, Any]:
    gcfg = GPTConfig(**c["model"])
    opts, offset = CONFIGS[c["config"]]
    seed = c["seed"] + offset
    torch.manual_seed(seed)
    model = GPT(gcfg).to(torch.bfloat16)
    opt = zerokern.parallelize(model, stage=c["stage"], unit_classes=(Block,), lr=c["lr"], **BC.HP,
                               seed=seed, **opts)
    losses, times = [], []
    start = time.perf_counter()
    for s in range(c["steps"]):
        for g in opt.param_groups:
            g["lr"] = lr_at(s, c["steps"], c["lr"])
        x, y = get_batch(s, rank, WORLD, c["micro_batch"], gcfg.seq)
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach().float())
        if rank == 0 and c["progress"] and (s + 1) % c["progress"] == 0:
            print(f"#   {c['config']} step {s + 1}: loss {losses[-1].item():.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    loss_t = torch.stack(losses)
    dist.all_reduce(loss_t)  # the global batch's loss: equal shares per rank
    stats = opt.comm_stats()
    model.eval()
    ev = torch.tensor(BC.evaluate(model, gcfg, c["eval_batches"], c["micro_batch"]))
    dist.all_reduce(ev)  # every rank evaluates the same batches: the mean is that loss
    return {
        "config": c["config"], "options": opts, "seed": seed, "steps": c["steps"],
        "losses": (loss_t / WORLD).tolist(), "eval_loss": ev.item() / WORLD,
        "step_ms": 1e3 * statistics.median(times), "train_s": time.perf_counter() - start,
        # the last step's, every kind (the quantized ones are outside stats["bytes"])
        "comm_bytes_per_step": sum(int(v["bytes"]) for v in stats["per_kind"].values()),
        "comm_per_kind": {k: {kk: int(vv) for kk, vv in v.items()
                              if isinstance(vv, (int, float))}
                          for k, v in stats.get("per_kind", {}).items()},
        "model": c["model"], "micro_batch": c["micro_batch"], "lr": c["lr"],
    }


def run_config(c: dict[str, Any], out: Path) -> dict[str, Any]:
    port = 29500 + (os.getpid() % 2000)
    mp.start_processes(_rank, args=(port, c, str(out)), nprocs=WORLD, start_method="spawn")
    return json.loads(out.read_text())


def report(rows: list[dict[str, Any]], stem: Path, header: str, tail: int) -> str:
    ref = next((r for r in rows if r["config"] == REF), None)
    for r in rows:
        r["final_loss"] = statistics.fmean(r["losses"][-tail:])
        r["last_loss"] = r["losses"][-1]
        r["mean_loss"] = statistics.fmean(r["losses"])
        r["lrs"] = [lr_at(s, r["steps"], r["lr"]) for s in range(r["steps"])]
    lines = [header, "", "| config | options | final loss (mean of last "
             f"{tail}) | vs base | last-step loss | vs base | eval loss | vs base | "
             "comm bytes/step/rank | ms/step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        def pct(k: str, r: dict[str, Any] = r) -> str:
            return f"{100 * (r[k] / ref[k] - 1):+.3f}%" if ref else ""

        opts = ", ".join(f"{k}={v!r}" for k, v in r["options"].items()) or "16-bit"
        if r["config"] == NOISE:
            opts += f" (seed {r['seed']})"
        cb = r.get("comm_bytes_per_step")
        lines.append(f"| {r['config']} | {opts} | {r['final_loss']:.4f} | {pct('final_loss')} "
                     f"| {r['last_loss']:.4f} | {pct('last_loss')} | {r['eval_loss']:.4f} | "
                     f"{pct('eval_loss')} | {f'{cb:,}' if cb else ''} | {r['step_ms']:.1f} |")
        for k in ("final_loss", "eval_loss"):
            if ref:
                r[f"{k}_vs_base_pct"] = 100 * (r[k] / ref[k] - 1)
    by = {r["config"]: r for r in rows}
    if ref:
        noise = abs(by[NOISE]["final_loss_vs_base_pct"]) if NOISE in by else None
        if noise is not None:
            lines.append(f"\n- noise floor (seed {by[NOISE]['seed']} vs seed {ref['seed']}, both "
                         f"16-bit): final loss {by[NOISE]['final_loss_vs_base_pct']:+.3f}%, eval "
                         f"{by[NOISE]['eval_loss_vs_base_pct']:+.3f}%")
        for name, goal in GOALS.items():
            if name in by:
                p = by[name]["final_loss_vs_base_pct"]
                lines.append(f"- {name}: final loss {p:+.3f}% vs base (goal: within {goal}%) -> "
                             f"{'met' if abs(p) <= goal else 'NOT met'}"
                             + (f"; {'within' if abs(p) <= noise else 'outside'} the noise "
                                f"floor ({noise:.3f}%)" if noise is not None else ""))
    md = "\n".join(lines)
    stem.with_suffix(".md").write_text(md + "\n")
    BC.write_curve(rows, stem.parent / f"{stem.name}_curve.csv")
    drawn = BC.plot(rows, stem.parent / f"{stem.name}_curve.png",
                    max(1, len(rows[0]["losses"]) // 40), header.split("  \n")[0])
    return md + ("" if drawn else "\n(no matplotlib: no plot)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="default: all")
    ap.add_argument("--steps", type=int, help="training steps (default 2000; --quick 8)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--n-layer", type=int, help=f"default {BC.MODEL.n_layer}")
    ap.add_argument("--n-embd", type=int, help=f"default {BC.MODEL.n_embd}")
    ap.add_argument("--n-head", type=int, help=f"default {BC.MODEL.n_head}")
    ap.add_argument("--seq", type=int, help=f"default {BC.MODEL.seq}")
    ap.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tail", type=int, default=100, help="steps averaged into the final loss")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--progress", type=int, default=0, help="print the loss every N steps")
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 steps")
    ap.add_argument("--fp32-linear", action="store_true",
                    help="bf16 linears computed in fp32 and rounded to bf16 (CPU speed)")
    ap.add_argument("--report", action="store_true",
                    help="no training: tables and plot from the configs' JSON files")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    steps = args.steps or (8 if args.quick else 2000)
    gcfg = BC.QUICK_MODEL if args.quick else BC.MODEL
    over = {k: getattr(args, k) for k in ("n_layer", "n_embd", "n_head", "seq")
            if getattr(args, k) is not None}
    gcfg = replace(gcfg, **over)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the header reports the ranks' thread count
    meta = H.machine(torch.device("cpu"))
    torch.set_num_threads(threads)
    name = f"bench_comm_convergence_cpu_{meta['date']}" + (f"_{args.tag}" if args.tag else "") \
        + ("_quick" if args.quick else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = args.configs or list(CONFIGS)
    model = (f"demo GPT {gcfg.n_layer}x{gcfg.n_embd}, {gcfg.n_head} heads, seq {gcfg.seq}, "
             f"{gcfg.num_params() / 1e6:.3f}M params, bf16, stage {args.stage} on {WORLD} gloo "
             "ranks")
    if not args.report:
        for cname in configs:
            c = {"config": cname, "model": asdict(replace(gcfg)), "steps": steps,
                 "micro_batch": args.micro_batch, "lr": args.lr, "seed": args.seed,
                 "eval_batches": 2 if args.quick else args.eval_batches,
                 "progress": args.progress, "stage": args.stage,
                 "fp32_linear": args.fp32_linear}
            r = run_config(c, out / f"{name}_{cname}.json")
            print(f"# {cname}: final loss {statistics.fmean(r['losses'][-args.tail:]):.4f}, "
                  f"eval {r['eval_loss']:.4f}, {r['step_ms']:.1f} ms/step, "
                  f"{r['train_s']:.0f} s", flush=True)
    rows = [json.loads(p.read_text()) for c in CONFIGS
            if (p := out / f"{name}_{c}.json").exists()]
    if not rows:
        print(f"# no results in {out} ({name}_<config>.json)", file=sys.stderr)
        return 1
    command = "python bench/bench_comm_convergence.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    header = (f"{meta['device']}, torch {meta['torch']}, {meta['date']}: {model}, micro-batch "
              f"{args.micro_batch} per rank, {steps} steps, lr {args.lr}.  \n`{command}`")
    print(report(rows, out / name, header, min(args.tail, steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
