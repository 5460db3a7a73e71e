"""End-to-end training step: zerokern ZeRO stages vs DDP, ZeroRedundancyOptimizer, FSDP2 and
DeepSpeed, side by side in one run on the same GPT, data, global batch, precision and device.

    python bench/bench_zero.py  # the reference workload (docs/how-it-works/conventions.md)
    python bench/bench_zero.py --precision bf16 --policies ddp zk_stage2
    python bench/bench_zero.py --quick                  # tiny model, 4 steps: a smoke test
    python bench/bench_zero.py --precision bf16 --policies ddp zk_stage2 --repeats 3
    python bench/bench_zero.py --repeats 3 --tree before=/path/to/old/checkout
    python bench/bench_zero.py --precision bf16 --policies ddp zk_stage2 zk_stage3 \
        zk_stage2_int8 zk_stage3_int8 --repeats 3        # 8-bit moments beside fp32 ones
    python bench/bench_zero.py --mesh 2x2 --precision bf16 --repeats 2   # flat vs hybrid
    python bench/bench_zero.py --mesh 2x2 --quantized --quick --precision bf16 --repeats 3

bench/README.md describes the workload, each policy and what each column measures. This file
is the command line and the output; the policies are in zero_policies.py, the ranks that run
them in zero_ranks.py. The "_int8" policies are zerokern's stages with ZeroAdamW(moments="int8")
(issue 27), "_int8_nomaster" also master="none" (bf16 only; --compressed adds them). With
--repeats N every policy (and every --tree variant) runs once per
round, N rounds in turn, and each ratio is taken to ddp of the same round: the median of the
N ratios is the result and their spread shows the noise. --mesh RxS (issue 28, zero_mesh.py):
flat against hybrid sharding (zerokern stages 1-3, FSDP2 HSDP) on an R x S mesh, in one set
of R*S ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
from gpt import GPTConfig  # noqa: E402
from zero_mesh import main_mesh, parse_mesh  # noqa: E402
from zero_policies import (  # noqa: E402
    COMPRESSED_POLICIES,
    FLAT_OF,
    MESH_POLICIES,
    OFFLOAD_POLICIES,
    POLICIES,
    QUANT_MESH_POLICIES,
    Job,
    unavailable,
)
from zero_ranks import run_policy  # noqa: E402

from zerokern.comm.rendezvous import file_init_method  # noqa: E402

REFERENCE = dict(
    cfg=GPTConfig(n_layer=6, n_embd=384, n_head=6, vocab=4096, seq=128), micro_batch=4, steps=30
)
QUICK = dict(
    cfg=GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab=256, seq=32), micro_batch=2, steps=4
)


@dataclass(frozen=True)
class Variant:
    """One source tree the policies run from: this checkout (label None) or --tree LABEL=PATH,
    whose rows are named policy@LABEL."""

    label: str | None = None
    path: Path | None = None

    def name(self, policy: str) -> str:
        return policy if self.label is None else f"{policy}@{self.label}"


def markdown(rows: list[dict[str, Any]], header: str, rounds: int = 1,
             trees: bool = False) -> str:
    cols = [
        ("policy", "policy"),
        ("status", "status"),
        ("steps_s", "steps/s"),
        ("step_ms", "step ms (median)" if rounds == 1 else "step ms: median (each round)"),
        ("x_time_vs_ddp", "time / ddp" if rounds == 1 else "time / ddp: median (min-max)"),
    ]
    if rounds > 1:
        cols.append(("x_time_vs_ddp_rounds", "time / ddp, each round"))
    if trees:
        cols.append(("x_time_vs_this_tree", "time / this tree"
                     + (": median (min-max), each round" if rounds > 1 else "")))
    cols += [
        ("state_mb", "model state MB/rank"),
        ("x_mem_vs_ddp", "mem / ddp"),
        ("comm_mb", "comm MB/step"),
        ("comm_ms", "comm ms/step"),
        ("loss", "final loss"),
    ]
    lines = [
        header,
        "",
        "| " + " | ".join(c[1] for c in cols) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|",
    ]
    for r in rows:
        cells = []
        for k, _ in cols:
            v = r.get(k, "")
            if k == "step_ms" and v != "":
                v = (f"{v:.0f} ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f})" if rounds == 1
                     else f"{v:.0f} ({r['step_ms_rounds']})")
            elif k in ("x_time_vs_ddp", "x_time_vs_this_tree") and v != "" and rounds > 1:
                v = f"{v:.3f} ({r[k + '_min']:.3f}-{r[k + '_max']:.3f})"
                if k == "x_time_vs_this_tree":
                    v += f": {r[k + '_rounds']}"
            elif isinstance(v, float):
                v = (
                    f"{v:.3f}"
                    if k in ("steps_s", "x_time_vs_ddp", "x_time_vs_this_tree", "x_mem_vs_ddp",
                             "loss")
                    else f"{v:.1f}"
                )
            cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_tree(spec: str) -> Variant:
    """--tree LABEL=PATH: a checkout whose zerokern package has its extension built in."""
    label, sep, path = spec.partition("=")
    if not sep or not label or not path or any(c in label for c in "@/ "):
        raise argparse.ArgumentTypeError(f"--tree wants LABEL=PATH (no '@', '/' or space in "
                                         f"LABEL), got {spec!r}")
    root = Path(path).expanduser().resolve()
    pkg = root / "zerokern"
    if not (pkg / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"--tree {spec}: no zerokern package in {root}")
    if not list(pkg.glob("_C*.so")) and not list(pkg.glob("_C*.pyd")):
        # Without it the ranks would quietly run the 'torch' backend: a different engine.
        raise argparse.ArgumentTypeError(
            f"--tree {spec}: {pkg} has no built extension (_C*.so); build it there or copy "
            f"this checkout's in (cp zerokern/_C*.so {pkg}/) if the C++ sources are the same")
    return Variant(label, root)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, help="timed steps (default 30; --quick: 4)")
    ap.add_argument(
        "--prof-steps",
        type=int,
        default=2,
        help="extra steps under torch.profiler for comm bytes/time (0: none)",
    )
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, help="per rank (default 4; --quick: 2)")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    ap.add_argument("--policies", nargs="+", default=POLICIES,
                    choices=list(dict.fromkeys(POLICIES + COMPRESSED_POLICIES + OFFLOAD_POLICIES
                                               + MESH_POLICIES + QUANT_MESH_POLICIES)))
    ap.add_argument("--offload", action="store_true",
                    help="add the ZeRO-Offload rows (zerokern and DeepSpeed offload, stages 2-3; "
                    "model-state columns are device bytes; bench_offload.py adds host bytes)")
    ap.add_argument("--compressed", action="store_true",
                    help="add the compressed-state rows (zerokern stages 2-3 with int8 moments, "
                    "with and without the fp32 master)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="interleaved rounds: every policy (and tree) once per round; ratios "
                    "to ddp of the same round, reported per round, median and min-max "
                    "(default 1: one run of each)")
    ap.add_argument("--tree", action="append", type=parse_tree, default=[],
                    metavar="LABEL=PATH",
                    help="also run every policy with zerokern imported from the checkout PATH "
                    "(its zerokern/_C*.so built or copied in), rows named policy@LABEL, "
                    "interleaved with this tree's in each round; repeatable")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per policy")
    ap.add_argument("--out", help="folder for the CSV (default bench/results)")
    ap.add_argument("--bucket-numel", type=int,
                    help="zerokern stages 0-2: bucket_numel (default: ZeroAdamW's own)")
    ap.add_argument("--quantized", action="store_true",
                    help="with --mesh: zerokern stage 3 flat and hybrid with each quantized "
                    "communication option (gather int8, reduce int8, reduce int4, gather int8 + "
                    "reduce int8 or int4, reduce int4 with error feedback) beside the 16-bit "
                    "rows and ddp, and hpZ (16-bit, gather int8, gather int8 + reduce int4)")
    ap.add_argument("--mesh", metavar="RxS",
                    help="flat vs hybrid sharding on a 2-D mesh of R replicas x S ranks "
                    "(world size R*S; default policies: ddp, fsdp2 / fsdp2_hsdp, zk_stageN / "
                    "zk_stageN_hybrid for N = 1-3), all in one set of ranks (zero_mesh.py)")
    args = ap.parse_args(argv)
    if args.mesh is not None:
        try:
            args.mesh = parse_mesh(args.mesh)
        except ValueError as exc:
            ap.error(str(exc))
        if args.world_size not in (2, args.mesh[0] * args.mesh[1]):
            ap.error(f"--world-size {args.world_size} differs from --mesh's R*S")
        args.world_size = args.mesh[0] * args.mesh[1]
        if args.policies is POLICIES:  # not given: the mesh's own list
            args.policies = QUANT_MESH_POLICIES if args.quantized else MESH_POLICIES
        bad = [p for p in args.policies if p not in MESH_POLICIES + QUANT_MESH_POLICIES]
        if bad or args.tree or args.offload or args.compressed:
            ap.error(f"--mesh runs only {' '.join(MESH_POLICIES)}, without --tree, --offload "
                     f"and --compressed (got policies {bad})")
    elif args.quantized:
        ap.error("--quantized needs --mesh RxS")
    elif any(p in FLAT_OF for p in args.policies):
        ap.error(f"policies {sorted(FLAT_OF)} need --mesh RxS")
    for flag, extra in ((args.compressed, COMPRESSED_POLICIES), (args.offload, OFFLOAD_POLICIES)):
        if flag:
            args.policies = list(args.policies) + [p for p in extra if p not in args.policies]
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    labels = [v.label for v in args.tree]
    if len(set(labels)) != len(labels):
        ap.error(f"--tree labels must differ: {labels}")
    if torch.device(args.device).type == "cuda" and torch.cuda.device_count() < args.world_size:
        ap.error(
            f"--world-size {args.world_size} needs as many GPUs ({torch.cuda.device_count()} here)"
        )
    return args


def run_one(
    args: argparse.Namespace, pol: str, prec: str, variant: Variant, job_args: dict[str, Any]
) -> dict[str, Any]:
    """One policy from one tree on fresh ranks: one row."""
    row: dict[str, Any] = {"policy": variant.name(pol), "precision": prec}
    if variant.label is not None:
        row["tree"] = variant.label
    why = unavailable(pol)
    if why:
        row["status"] = f"skipped: {why}"
        return row
    # One folder per run: its rendezvous file and its ranks' result files.
    with tempfile.TemporaryDirectory(prefix="bench_zero_") as tmp:
        job = Job(pol, prec, **job_args, init_method=file_init_method(tmp), outdir=tmp)
        row.update(run_policy(job, args.timeout, tree=variant.path))
    return row


def add_ratios(rows: list[dict[str, Any]], variants: list[Variant]) -> None:
    """Ratios within one round: to ddp of the same tree (else this tree's ddp), and for a
    --tree row to the same policy from this tree."""
    ok = {r["policy"]: r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        base_pol, _, label = r["policy"].partition("@")
        v = next(v for v in variants if v.label == (label or None))
        base = ok.get(v.name("ddp")) or ok.get("ddp")
        if base:
            r["x_time_vs_ddp"] = r["step_ms"] / base["step_ms"]
            r["x_mem_vs_ddp"] = r["state_mb"] / base["state_mb"]
        here = ok.get(base_pol)
        if label and here:
            r["x_time_vs_this_tree"] = r["step_ms"] / here["step_ms"]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from one policy's rounds: the step time is the median over rounds; each ratio
    the median of the per-round ratios (not the ratio of the medians), with its spread and
    every round's value. Bytes, loss and optim are the same every round (deterministic); the
    last ok round gives them."""
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return {k: v for k, v in runs[0].items() if k != "round"}
    row = {k: v for k, v in ok[-1].items() if k != "round" and not k.startswith("x_time")}
    if len(ok) < len(runs):
        bad = next(r for r in runs if r["status"] != "ok")
        row["status"] = f"ok in {len(ok)}/{len(runs)} rounds; round {bad['round']}: " + bad[
            "status"]
    ms = [r["step_ms"] for r in ok]
    row.update(
        rounds=len(ok),
        steps_s=1e3 / statistics.median(ms),
        step_ms=statistics.median(ms),
        step_ms_min=min(r["step_ms_min"] for r in ok),
        step_ms_max=max(r["step_ms_max"] for r in ok),
        step_ms_rounds=" / ".join(f"{x:.0f}" for x in ms),
        first_step_ms=statistics.median(r["first_step_ms"] for r in ok),
    )
    if "comm_ms" in row:
        row["comm_ms"] = statistics.median(r["comm_ms"] for r in ok)
    for k in ("rss_mb", "max_alloc_mb", "max_reserved_mb"):
        if k in row:
            row[k] = max(r[k] for r in ok)
    for k in ("x_time_vs_ddp", "x_time_vs_this_tree"):
        row.update(H.ratio_stats([r[k] for r in ok if k in r], k))
    return row


def run_precision(
    args: argparse.Namespace,
    prec: str,
    job_args: dict[str, Any],
    meta: dict[str, Any],
    variants: list[Variant] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every policy from every tree, on fresh ranks, ``args.repeats`` rounds in turn; the
    ratios of each round, then one row per policy and tree. Returns (summary rows, round
    rows); with one round they are the same rows. Within a round the trees of one policy run
    back to back, in reverse order every other round, so that neither gains by its place."""
    variants = variants or [Variant()]
    names = [v.name(p) for p in args.policies for v in variants]
    multi = args.repeats > 1 or len(variants) > 1
    all_runs: list[dict[str, Any]] = []
    for rnd in range(1, args.repeats + 1):
        rows = []
        for pol in args.policies:
            for v in variants if rnd % 2 else variants[::-1]:
                row = run_one(args, pol, prec, v, job_args)
                if args.repeats > 1:
                    row["round"] = rnd
                if row["status"] != "ok":
                    print(f"# {row['policy']} ({prec}): {row['status']}")
                elif multi:
                    print(f"#   round {rnd}, {row['policy']} ({prec}): "
                          f"{row['step_ms']:.1f} ms/step")
                rows.append(row)
        # After the metadata: the CSV's columns keep that order (ratios last).
        rows = [{**r, **meta} for r in sorted(rows, key=lambda r: names.index(r["policy"]))]
        add_ratios(rows, variants)
        all_runs += rows
    if args.repeats == 1:
        return all_runs, all_runs
    summary = [summarize([r for r in all_runs if r["policy"] == n]) for n in names]
    # Bytes are the same every round: a ddp that ran in only some rounds still gives them.
    base = {r["policy"]: r for r in summary if "state_mb" in r}
    for r in summary:
        ddp = base.get(Variant(r.get("tree")).name("ddp")) or base.get("ddp")
        if "state_mb" in r and ddp:
            r["x_mem_vs_ddp"] = r["state_mb"] / ddp["state_mb"]
    return summary, all_runs


def report(rows: list[dict[str, Any]], prec: str, device: torch.device, header: str,
           rounds: int = 1, trees: bool = False) -> None:
    """The table and the per-policy notes on stdout, then the markdown table."""
    print(f"\n## {prec}")
    cols = [
        "policy",
        "status",
        "steps_s",
        "step_ms",
        "step_ms_min",
        "step_ms_max",
        "x_time_vs_ddp",
    ]
    if rounds > 1:
        cols += ["x_time_vs_ddp_min", "x_time_vs_ddp_max", "step_ms_rounds"]
    if trees:
        cols += ["x_time_vs_this_tree"]
    cols += [
        "state_mb",
        "x_mem_vs_ddp",
        "params_mb",
        "grads_mb",
        "optim_mb",
        "comm_mb",
        "comm_ms",
        "loss",
    ]
    cols += ["rss_mb"] if device.type == "cpu" else ["max_alloc_mb", "max_reserved_mb"]
    H.print_table([{**r, "status": r["status"][:40]} for r in rows], cols)
    for r in rows:
        if "optim" in r:
            print(
                f"#   {r['policy']}: {r['optim']}; comm {r.get('comm_kinds', '')}"
                + (f"; comm_stats {r['zk_comm_mb']:.2f} MB" if "zk_comm_mb" in r else "")
                + (f"; zerokern from {r['zerokern_dir']}" if "zerokern_dir" in r else "")
            )
    print("\n" + markdown(rows, header, rounds, trees))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mesh is not None:
        return main_mesh(args, QUICK if args.quick else None, "python bench/bench_zero.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]))
    ref = QUICK if args.quick else REFERENCE
    cfg: GPTConfig = ref["cfg"]
    steps = args.steps or ref["steps"]
    mb = args.micro_batch or ref["micro_batch"]
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks' setting, so machine() reports it
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop chatter
    meta = H.machine(device)
    meta.update(
        world_size=args.world_size,
        backend="nccl" if device.type == "cuda" else "gloo",
        model=f"GPT {cfg.n_layer}x{cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab}, "
        f"seq {cfg.seq}, {cfg.num_params() / 1e6:.2f}M params",
        micro_batch=mb,
        global_batch=mb * args.world_size,
        steps=steps,
    )
    job_args = dict(
        device=device.type,
        cfg=asdict(cfg),
        micro_batch=mb,
        steps=steps,
        prof_steps=args.prof_steps,
        world=args.world_size,
        bucket_numel=args.bucket_numel,
    )
    command = "python bench/bench_zero.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(
        f"# {meta['device']} | torch {meta['torch']} | {meta['date']} | {meta['model']} | "
        f"{args.world_size} ranks ({meta['backend']}), micro-batch {mb}, {steps} steps"
    )
    variants = [Variant(), *args.tree]
    for v in args.tree:
        print(f"# tree {v.label}: zerokern from {v.path / 'zerokern'} (rows policy@{v.label})")
    for prec in args.precision:
        rows, runs = run_precision(args, prec, job_args, meta, variants)
        rounds = (
            f", {args.repeats} interleaved rounds, ratios to ddp of the same round"
            if args.repeats > 1 else ""
        )
        header = (
            f"**{prec}**, {meta['device']}, torch {meta['torch']}, {meta['date']}: "
            f"{meta['model']}, {args.world_size} ranks over {meta['backend']}, micro-batch "
            f"{mb}/rank, median of steps 3..{steps}{rounds}.  \n`{command}`"
        )
        report(rows, prec, device, header, args.repeats, bool(args.tree))
        name = f"bench_zero_{device.type}_{prec}_{meta['date']}{'_quick' if args.quick else ''}"
        path = H.write_csv(rows, name + ".csv", args.out)
        print(f"# wrote {path}")
        if args.repeats > 1:
            print(f"# wrote {H.write_csv(runs, name + '_rounds.csv', args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
