"""``python -m zerokern demo``: train a small GPT once per ZeRO policy and check the paper.

Without a GPU it spawns ``--world-size`` CPU ranks (default 2) talking over gloo, one thread
each; with GPUs one rank per GPU over NCCL; when started by ``torchrun`` (RANK and WORLD_SIZE
set) it uses that launch instead of spawning. Each policy (stage 0 = DDP-like, 1, 2, 3) trains
the same model (zerokern/demo/gpt.py) from the same weights on the same locally generated text
(zerokern/demo/data.py). The table compares, per policy, the final loss, the model-state bytes
a rank holds against the paper's §5.4 formula, and the elements communicated per step against
§7 (2Ψ, 3Ψ); it is written as CSV and PNG into ``--out``. Compressed bars follow: the same
model under stage 3 with a compressed optimizer state (``--compressed``, by default int8
moments with and without an fp32 master), memory only, built and not trained. The command
exits 1 when a check fails, so it doubles as an end-to-end test. The default run (GPT
"small", 50 steps per policy) takes about half a minute on two idle CPU cores; ``--steps``
and ``--model`` make it longer.

Default precision: bf16 parameters with fp32 master weights and moments, on CPU too. It is the
paper's setting (2 + 2 + K bytes, K = 12), so the formula column is the paper's own; on CPU
ranks over gloo the policies' losses are bit-identical in bf16 as in fp32; and on a CPU with
native bf16 (AVX512-BF16 / AMX) it is no slower than fp32. ``--precision fp32`` (K = 8) runs
faster on CPUs without bf16 support.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

HELP = "train a small GPT with ZeRO stages 0-3 and check memory/communication against the paper"


def _options(args):
    from ..demo.train import DemoOptions

    return DemoOptions(
        stages=tuple(args.stages),
        steps=args.steps,
        model_size=args.model_size,
        precision=args.precision,
        micro_batch=args.micro_batch,
        lr=args.lr,
        seed=args.seed,
        bucket_numel=args.bucket_numel,
        max_grad_norm=args.max_grad_norm,
        compressed=None if args.compressed is None else tuple(args.compressed),
    )


def _quiet_torch_warnings() -> None:
    # Other torch.distributed deprecation notices (e.g. from DDP or torch 2.11's names) would
    # print one line per rank per policy in the demo's output.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\..*` is deprecated")


def _rank_main(opts, device):
    """Train every policy on this (initialised) rank; rank 0 returns the merged records."""
    import torch

    from ..demo.train import train_all

    if device.type == "cuda":
        torch.cuda.set_device(device)
    return train_all(opts, device)


def _spawned(rank: int, world: int, init_file: str, opts, backend: str, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    from ..demo.train import release_all

    _quiet_torch_warnings()
    if backend == "gloo":
        torch.set_num_threads(1)  # the ranks share the machine's cores
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    # A file rendezvous in the run's temporary folder: no port to pick, so none to race for.
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        results = _rank_main(opts, device)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(results, f)
    finally:
        release_all()


def _describe(opts, world: int, backend: str, device: str) -> str:
    from ..demo import VOCAB, config_for
    from ..demo.train import COMPRESSED_STAGE, compressed_formats

    cfg = config_for(opts.model_size, VOCAB)
    bars = compressed_formats(opts)
    more = ""
    if bars:
        more = f"; memory of stage {COMPRESSED_STAGE} with " + ", ".join(
            f"{m} moments" + (" and no master" if ma == "none" else "") for m, ma in bars)
    return (
        f"zerokern demo: GPT '{opts.model_size}' ({cfg.num_params():,} parameters: "
        f"{cfg.n_layer} blocks, d_model {cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab}, "
        f"sequence {cfg.seq}), {world} {device} rank{'s' if world > 1 else ''} over "
        f"{backend}, {opts.precision}, "
        f"global batch {world} x {opts.micro_batch} x {cfg.seq} characters, "
        f"{opts.steps} steps x {len(opts.stages)} "
        f"{'policies (stages' if len(opts.stages) > 1 else 'policy (stage'} "
        f"{' '.join(map(str, opts.stages))}){more}"
    )


def _report(results: list[dict], opts, args, header: str) -> int:
    from ..demo.report import (
        LOSS_RTOL,
        build_rows,
        format_table,
        write_csv,
        write_losses_csv,
        write_png,
    )

    rtol = args.loss_rtol if args.loss_rtol is not None else LOSS_RTOL[opts.precision]
    rows, summary = build_rows(results, opts.precision, rtol)
    table = format_table(rows, summary)
    os.makedirs(args.out, exist_ok=True)
    paths = {
        name: os.path.join(args.out, name)
        for name in ("demo_table.csv", "demo_losses.csv", "demo_table.md", "demo.png")
    }
    write_csv(rows, paths["demo_table.csv"])
    write_losses_csv(results, paths["demo_losses.csv"])
    with open(paths["demo_table.md"], "w") as f:
        f.write(header + "\n\n" + table + "\n")
    why_not = write_png(rows, results, paths["demo.png"], header.replace("zerokern demo: ", ""))
    print()
    print(table)
    print()
    for name in ("demo_table.csv", "demo_losses.csv", "demo_table.md"):
        print(f"wrote {paths[name]}")
    if why_not is None:
        print(f"wrote {paths['demo.png']}")
    else:
        print(f"no chart: {why_not}")
    if not summary["ok"]:
        print("zerokern demo: FAILED: a check above does not hold", file=sys.stderr)
        return 1
    return 0


def _run_launched(opts, args) -> int:
    """Already started by torchrun (or similar): use its process group."""
    import torch
    import torch.distributed as dist

    from ..comm import Comm
    from ..demo.train import release_all

    _quiet_torch_warnings()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    header = _describe(opts, world, dist.get_backend(), "GPU" if use_cuda else "CPU")
    if rank == 0:
        print(header, flush=True)
    try:
        t0 = time.perf_counter()
        results = _rank_main(opts, device)
        code = [0]
        if rank == 0:
            code = [_report(results, opts, args, header)]
            print(f"wall time {time.perf_counter() - t0:.0f} s")
        # Every rank exits like rank 0 (through Comm: its collectives keep their tensors
        # until the backend has let go, so the exit right after this one is clean).
        return int(Comm().all_gather_object(code[0], "demo exit code")[0])
    finally:
        release_all()


def run(args) -> int:
    err = _validate(args)
    if err:
        print(f"zerokern demo: error: {err}", file=sys.stderr)
        return 2
    opts = _options(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_launched(opts, args)

    import torch
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus else "gloo"
    world = args.world_size or (gpus if gpus else 2)
    header = _describe(opts, world, backend, "GPU" if gpus else "CPU")
    print(header, flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zerokern_demo_") as tmp:
        result_path = os.path.join(tmp, "results.json")
        try:
            mp.start_processes(
                _spawned,
                args=(world, os.path.join(tmp, "rendezvous"), opts, backend, result_path),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
        except Exception as exc:  # a rank raised: its traceback is in the message
            print(f"zerokern demo: a rank failed:\n{exc}", file=sys.stderr)
            return 1
        with open(result_path) as f:
            results = json.load(f)
    code = _report(results, opts, args, header)
    print(
        f"wall time {time.perf_counter() - t0:.0f} s (training and report; "
        f"add about 3 s for starting Python)"
    )
    return code


def _validate(args) -> str | None:
    if len(set(args.stages)) != len(args.stages):
        return f"--stages has duplicates: {args.stages}"
    if args.steps < 1:
        return "--steps must be >= 1"
    if args.world_size is not None and args.world_size < 1:
        return "--world-size must be >= 1"
    if args.micro_batch < 1 or (args.bucket_numel is not None and args.bucket_numel < 1):
        return "--micro-batch and --bucket-numel must be >= 1"
    return _validate_compressed(args.compressed, args.precision)


def _validate_compressed(specs: list[str] | None, precision: str) -> str | None:
    from ..demo.train import parse_format
    from ..formulas import MASTER_MODES, MOMENT_FORMATS

    for spec in specs or ():
        moments, master = parse_format(spec)
        if moments not in MOMENT_FORMATS or master not in MASTER_MODES:
            return (f"--compressed {spec!r}: expected MOMENTS[:MASTER] with MOMENTS one of "
                    f"{', '.join(MOMENT_FORMATS)} and MASTER one of {', '.join(MASTER_MODES)}")
        if master == "none" and precision != "bf16":
            return f"--compressed {spec!r}: master 'none' needs --precision bf16"
    if specs is not None and len(set(map(parse_format, specs))) != len(specs):
        return f"--compressed has duplicates: {specs}"
    return None


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--stages",
        type=int,
        nargs="+",
        choices=(0, 1, 2, 3),
        default=[0, 1, 2, 3],
        metavar="S",
        help="ZeRO stages to train, in this order (default: 0 1 2 3)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=50,
        help="training steps per policy (default: %(default)s; the whole run takes about half a "
        "minute on 2 idle CPU cores; --steps 200 draws a longer loss curve)",
    )
    p.add_argument(
        "--model",
        "--model-size",
        dest="model_size",
        choices=("tiny", "small", "base"),
        default="small",
        help="model size preset: tiny (0.1M params, for tests), small (3.2M, default) or "
        "base (10.7M, the benchmarks' reference 6 x 384 shape; several times slower per step)",
    )
    p.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default="bf16",
        help="bf16 parameters + fp32 master (default; the paper's K = 12) or fp32",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks to spawn (default: 2 on CPU, one per GPU); ignored under torchrun",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=8,
        help="sequences per rank per step (default: %(default)s)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="initial weights (default: 0)")
    p.add_argument(
        "--bucket-numel",
        type=int,
        default=None,
        help="ZeroAdamW gradient bucket size in elements (default: Ψ/8, 8 buckets)",
    )
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=None,
        help="clip gradients to this global norm (default: no clipping)",
    )
    p.add_argument(
        "--compressed",
        nargs="*",
        default=None,
        metavar="MOMENTS[:MASTER]",
        help="compressed bars: the model under stage 3 with ZeroAdamW(moments=MOMENTS, "
        "master=MASTER), memory only (default: int8 int8:none with bf16, int8 with fp32; "
        "--compressed alone: none)",
    )
    p.add_argument(
        "--loss-rtol",
        type=float,
        default=None,
        help="allowed relative difference of final losses (default: 1e-4 fp32, 2e-2 bf16)",
    )
    p.add_argument(
        "--out",
        default="zerokern_demo_out",
        help="directory for the CSV and PNG (default: ./zerokern_demo_out)",
    )
    p.set_defaults(func=run)
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``demo`` on a dispatcher's ``add_subparsers()`` object."""
    p = subparsers.add_parser("demo", help=HELP, description=__doc__.split("\n\n")[1])
    return configure_parser(p)


def main(argv=None) -> int:
    parser = configure_parser(argparse.ArgumentParser(prog="zerokern demo"))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
