"""``python -m zerokern estimate``: per-GPU memory and per-step communication of ZeRO-DP.

Only the command line lives here: argument types, the parser, cross-option checks, and
``run``/``main``. The numbers come from :func:`zerokern.estimate.estimate` (pure arithmetic on
the paper's formulas in :mod:`zerokern.formulas`), the text and the chart from
:mod:`zerokern.cli.estimate_report`. Nothing here imports torch, so the command starts fast;
matplotlib is imported only for ``--plot``.

The formulas are those of the ZeRO paper (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", arXiv:1910.02054v3); GB means 1e9 bytes, as there
(7.5B parameters on 64 GPUs: 120, 31.4, 16.6, 1.88 GB).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

from .. import estimate as _estimate_module
from .. import formulas as _formulas
from ..estimate import CLUSTER_DEFAULTS, DEFAULT_GPUS, estimate
from ..formulas import DEFAULT_K, MASTER_MODES, MOMENT_FORMATS, gpt_params
from . import estimate_report as _report
from .estimate_report import PlotUnavailable, format_report, import_pyplot, plot_memory
from .quantized_report import format_quantized

# This module used to hold the formulas, the report dict and the text output too, and callers
# wrote ``from zerokern.cli import estimate as est; est.mem_os(...)``. Forward those public
# names to their new homes rather than re-import each one here; new code should import from
# zerokern.formulas, zerokern.estimate or zerokern.cli.estimate_report directly.
_FORMER_HOMES = (_formulas, _estimate_module, _report)


def __getattr__(name: str) -> Any:
    """The former single-file module's public names (PEP 562 module attribute hook)."""
    if not name.startswith("_"):
        for module in _FORMER_HOMES:
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# argparse
# --------------------------------------------------------------------------------------------

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _param_count(text: str) -> float:
    m = re.fullmatch(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"expected a number of parameters such as 7.5e9 or 7.5B, got {text!r}"
        )
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of parameters, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


HELP = "per-GPU memory and communication of ZeRO stages 0-3 (paper §5.4, §7)"
DESCRIPTION = (
    "Per-GPU model-state memory of plain data parallelism and ZeRO stages 1-3 (the ZeRO "
    "paper's §5.4 / Table 1), per-step communication volume (§7) and, optionally, activation "
    "memory. GB = 1e9 bytes. --moments/--master give K of a compressed optimizer state "
    "(ZeroAdamW(moments=, master=)). --nodes (with --gpus-per-node, --hybrid and the links' "
    "bandwidths and latencies) adds memory, traffic per link and communication time per step "
    "across nodes, flat vs hybrid. Example: --params 7.5e9 --gpus 1 4 16 64 256 1024 "
    "--gpu-mem 32; --params 7.5e9 --nodes 4 --gpus-per-node 8 --hybrid"
)


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the estimate options to ``p`` (the dispatcher's subparser, or a standalone parser)."""
    size = p.add_argument_group("model size (give --params, or --layers and --hidden)")
    size.add_argument(
        "--params",
        type=_param_count,
        metavar="PSI",
        help="number of parameters, e.g. 7.5e9 or 7.5B (suffixes K, M, B, T)",
    )
    size.add_argument(
        "--layers", type=_positive_int, metavar="L", help="transformer layers (GPT-like)"
    )
    size.add_argument("--hidden", type=_positive_int, metavar="H", help="hidden width")
    p.add_argument(
        "--gpus",
        type=_positive_int,
        nargs="+",
        default=list(DEFAULT_GPUS),
        metavar="N",
        help="data-parallel GPU counts, one table row each (default: %(default)s)",
    )
    p.add_argument(
        "--k",
        type=_nonneg_float,
        default=None,
        metavar="K",
        help=f"optimizer-state bytes per parameter (default: the format's, {DEFAULT_K:g} for "
        "mixed-precision Adam with fp32 moments and master)",
    )
    p.add_argument(
        "--moments",
        choices=MOMENT_FORMATS,
        default="fp32",
        help="ZeroAdamW(moments=): Adam moments in fp32 (default), bf16 or int8 (block-wise, "
        "one fp32 absmax per 256 elements); sets K",
    )
    p.add_argument(
        "--master",
        choices=MASTER_MODES,
        default="fp32",
        help="ZeroAdamW(master=): an fp32 master copy (default) or none (bf16 parameters "
        "updated with stochastic rounding); sets K",
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="muon: also the owner exchange of ZeroOptimizer(..., torch.optim.Muon) on the "
        "hidden matrices (buffers per GPU, bytes per step); needs --layers and --hidden",
    )
    p.add_argument(
        "--gpu-mem",
        type=_positive_float,
        metavar="GB",
        help="memory per GPU in GB (1e9 bytes); marks what fits and the fewest GPUs that fit",
    )
    p.add_argument(
        "--host-mem",
        type=_positive_float,
        metavar="GB",
        help="host memory per rank in GB (1e9 bytes) for the ZeRO-Offload rows (offload='cpu')",
    )
    p.add_argument(
        "--bandwidth",
        type=_positive_float,
        metavar="GB/s",
        help="per-GPU link bandwidth in GB/s, to turn communication volume into time",
    )
    nodes = p.add_argument_group(
        "across nodes (optional; need --nodes)",
        "memory, traffic per link and communication time per step, flat vs hybrid")
    nodes.add_argument("--nodes", type=_positive_int, metavar="R",
                       help="nodes; adds the across-nodes section (flat: the state divided "
                       "over all nodes x GPUs)")
    d = CLUSTER_DEFAULTS
    nodes.add_argument("--gpus-per-node", type=_positive_int, metavar="G",
                       help=f"GPUs (ranks) per node (default {d['gpus_per_node']})")
    nodes.add_argument("--hybrid", action="store_true",
                       help="also the hybrid layout (FSDP2's HSDP): state sharded over a "
                       "node's GPUs, replicated across nodes")
    for link, note in (("intra", ": NVLink-class"), ("inter", " = 200 Gb/s; 400 Gb/s is 50")):
        nodes.add_argument(f"--{link}-bw", type=_positive_float, metavar="GB/s",
                           help=f"{link}-node bandwidth per GPU and direction (default "
                           f"{d[f'{link}_bw_gb_s']:g}{note})")
        nodes.add_argument(f"--{link}-latency", type=_nonneg_float, metavar="US",
                           help=f"{link}-node latency per ring step in microseconds (default "
                           f"{d[f'{link}_latency_s'] * 1e6:g})")
    quant = p.add_argument_group(
        "quantized communication (optional; need --nodes)",
        "bytes per step and GPU on each kind of link and communication time per step at "
        "several inter-node speeds, 16-bit beside each option (ZeroAdamW(gather_dtype=, "
        "reduce_dtype=)); stages 1-2 and 3")
    quant.add_argument("--gather-dtype", choices=("int8",),
                       help="ZeroAdamW(gather_dtype=): the parameter all-gathers in int8 codes")
    quant.add_argument("--reduce-dtype", choices=("int8", "int4"),
                       help="ZeroAdamW(reduce_dtype=): the gradient reduce in int8 or int4 codes")
    quant.add_argument("--inter-gbits", type=_positive_float, nargs="+", metavar="GBIT/S",
                       help="inter-node link speeds per GPU in Gb/s, one time column each "
                       "(default: 25 100 400)")
    quant.add_argument("--hpz", action="store_true",
                       help="also the hpZ layout, stage 3 (shard_model(mesh=, hpz=True), "
                       "ZeRO++'s hpZ): sharded over all GPUs, the backward's gathers from an "
                       "in-node secondary copy (its GB per GPU in its own column)")
    nodes.add_argument("--bucket-numel", type=_positive_int, metavar="N",
                       help="elements per collective call, for the latency term (default "
                       f"{d['bucket_numel']}, ZeroAdamW's bucket_numel)")
    act = p.add_argument_group("activations (optional; need --layers and --hidden)")
    act.add_argument("--batch", type=_positive_int, metavar="B", help="micro-batch per GPU")
    act.add_argument("--seq", type=_positive_int, metavar="S", help="sequence length")
    act.add_argument(
        "--checkpointing",
        action="store_true",
        help="count checkpointed activations (not the full ones) against --gpu-mem",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the numbers as JSON")
    out.add_argument(
        "--plot",
        metavar="OUT.png",
        help="also write the §5.4 chart (memory per GPU vs GPUs, log axes); needs matplotlib",
    )
    p.set_defaults(func=run, _estimate_parser=p)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``estimate`` on a dispatcher's ``add_subparsers()`` object."""
    p = subparsers.add_parser("estimate", help=HELP, description=DESCRIPTION)
    return configure_parser(p)


def _validate(args: argparse.Namespace) -> str | None:
    # combinations argparse cannot express; None when the options are consistent
    if (args.layers is None) != (args.hidden is None):
        return "--layers and --hidden must be given together"
    if args.params is None and args.layers is None:
        return "give the model size: --params PSI, or --layers L and --hidden H"
    if (args.batch is None) != (args.seq is None):
        return "--batch and --seq must be given together"
    if args.batch is not None and args.layers is None:
        return "--batch/--seq (activation memory) also need --layers and --hidden"
    if args.checkpointing and args.batch is None:
        return "--checkpointing needs --batch, --seq, --layers and --hidden"
    if args.optimizer == "muon" and args.layers is None:
        return "--optimizer muon needs --layers and --hidden (the matrices' shapes)"
    if args.k is not None and (args.moments, args.master) != ("fp32", "fp32"):
        return "give --k or --moments/--master, not both (the format decides K)"
    if args.nodes is None:
        for flag in ("gpus_per_node", "hybrid", "intra_bw", "inter_bw", "intra_latency",
                     "inter_latency", "bucket_numel", "gather_dtype", "reduce_dtype",
                     "inter_gbits", "hpz"):
            if getattr(args, flag) not in (None, False):
                return f"--{flag.replace('_', '-')} needs --nodes (the across-nodes section)"
    return None


def run(args: argparse.Namespace) -> int:
    """Run the subcommand on parsed arguments; returns the exit status."""
    err = _validate(args)
    if err is not None:
        parser = getattr(args, "_estimate_parser", None)
        if parser is not None:
            parser.print_usage(sys.stderr)
            prog = parser.prog
        else:
            prog = "estimate"
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2

    if args.params is not None:
        psi, source = args.params, "params"
    else:
        psi, source = float(gpt_params(args.layers, args.hidden)), "layers_hidden"

    report = estimate(
        psi,
        gpus=args.gpus,
        k=args.k,
        gpu_mem_gb=args.gpu_mem,
        bandwidth_gb_s=args.bandwidth,
        layers=args.layers,
        hidden=args.hidden,
        batch=args.batch,
        seq=args.seq,
        checkpointing=args.checkpointing,
        param_source=source,
        host_mem_gb=args.host_mem,
        moments=args.moments,
        master=args.master,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        hybrid=args.hybrid,
        intra_bw_gb_s=args.intra_bw,
        inter_bw_gb_s=args.inter_bw,
        intra_latency_s=None if args.intra_latency is None else args.intra_latency / 1e6,
        inter_latency_s=None if args.inter_latency is None else args.inter_latency / 1e6,
        bucket_numel=args.bucket_numel,
        optimizer=args.optimizer,
        gather_dtype=args.gather_dtype,
        reduce_dtype=args.reduce_dtype,
        inter_gbits=args.inter_gbits,
        hpz=args.hpz,
    )

    # Do the plot (the only step that can fail) before printing anything.
    if args.plot:
        try:
            plt = import_pyplot()
        except PlotUnavailable as exc:
            print(f"zerokern estimate: error: {exc}", file=sys.stderr)
            return 2
        try:
            plot_memory(report, args.plot, plt=plt)
        except (OSError, ValueError) as exc:
            print(
                f"zerokern estimate: error: could not write {args.plot!r}: {exc}", file=sys.stderr
            )
            return 1
        report["plot"] = args.plot

    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        if report["quantized"] is not None:
            print("\n" + format_quantized(report["quantized"]))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m zerokern.cli.estimate ...``."""
    parser = configure_parser(
        argparse.ArgumentParser(prog="zerokern estimate", description=DESCRIPTION)
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
