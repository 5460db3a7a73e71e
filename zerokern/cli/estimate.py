"""``python -m zerokern estimate``: per-GPU memory and per-step communication of ZeRO-DP.

Pure arithmetic from the ZeRO paper (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", arXiv:1910.02054v3). Nothing here imports torch, so the
command starts fast; matplotlib is imported only for ``--plot``.

Notation (paper §3.1, §5): Psi parameters, N data-parallel GPUs (the paper's N_d), K bytes of
optimizer state per parameter (K = 12 for mixed-precision Adam: fp32 master weight, momentum
and variance), 2-byte fp16/bf16 parameters and gradients. Model-state bytes per GPU (§5.4):

    stage 0  plain DP    (2 + 2 + K) Psi
    stage 1  P_os        4 Psi + K Psi / N
    stage 2  P_os+g      2 Psi + (2 + K) Psi / N
    stage 3  P_os+g+p    (2 + 2 + K) Psi / N

GB means 1e9 bytes, as in the paper (7.5B parameters on 64 GPUs: 120, 31.4, 16.6, 1.88 GB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
from decimal import ROUND_HALF_UP, Decimal

from ..formulas import (  # noqa: F401 - re-exported: the estimate API
    COMM_BYTES,
    COMM_FORMULAS,
    DEFAULT_K,
    GB,
    GRAD_BYTES,
    PARAM_BYTES,
    STAGE_FORMULAS,
    STAGE_NAMES,
    STAGES,
    check_psi_n,
    comm_bytes,
    comm_elements,
    comm_seconds,
    fits,
    mem_dp,
    mem_os,
    mem_os_g,
    mem_os_g_p,
    min_gpus_to_fit,
    model_state_bytes,
)

ACT_BYTES = 2  # bytes per stored activation value (fp16/bf16)
DEFAULT_GPUS = (1, 4, 16, 64, 256, 1024)  # the N_d rows of the paper's Table 1

COMM_NOTE = (
    "Counted as the paper's §7 counts it: the data volume of the step's collectives "
    "(DP and stages 1-2: reduce-scatter + all-gather = 2*Psi; stage 3: all-gather in forward "
    "+ all-gather in backward + gradient reduce-scatter = 3*Psi). With ring algorithms each "
    "GPU sends, and receives, about this volume ((N-1)/N of it exactly; nothing at N = 1), "
    "so time = bytes / per-GPU link bandwidth, ignoring latency and overlap with compute."
)


# --------------------------------------------------------------------------------------------
# Model size and activations
# --------------------------------------------------------------------------------------------


def gpt_params(layers: int, hidden: int) -> int:
    """Parameters of a GPT-like transformer: about 12 * layers * hidden**2.

    (4 h^2 attention + 8 h^2 MLP per layer; embeddings, biases and norms ignored. The annotated
    paper's §10.1 uses it: 125 layers of width 8192 -> 100.7B.)
    """
    return 12 * int(layers) * int(hidden) ** 2


def activation_values(hidden: int, batch: int, seq: int, layers: int) -> int:
    """Activation values kept for backward without checkpointing: 12 * h * b * s * L.

    Paper §3.2 (footnote), for a GPT-2-like model: "about 12 x hidden_dim x batch x seq_length
    x transformer_layers"; GPT-2 1.5B (h=1600, L=48) at b=32, s=1024 -> 30.2e9 values, the
    paper's "about 60 GB" at 2 bytes each.
    """
    return 12 * int(hidden) * int(batch) * int(seq) * int(layers)


def checkpoint_values(hidden: int, batch: int, seq: int, layers: int) -> int:
    """Values kept with activation checkpointing, one checkpoint per layer: h * b * s * L.

    Paper §6.1: a checkpoint is the transformer layer's input, b * s * h values, one per layer
    (the 100B model, L=125, h=8192, b=32, s=1024 -> 33.6e9 values, the paper's "about 33 GB").
    The recomputed layer's own activations come on top during backward; the paper's "about
    8 GB" for checkpointed GPT-2 1.5B (§3.2) is a rough sqrt estimate, not this formula.
    """
    return int(hidden) * int(batch) * int(seq) * int(layers)


def activation_bytes(
    hidden: int, batch: int, seq: int, layers: int, bytes_per_value: float = ACT_BYTES
) -> float:
    """Bytes of activations without checkpointing (12 h b s L values, 2 bytes each)."""
    return activation_values(hidden, batch, seq, layers) * bytes_per_value


def checkpoint_bytes(
    hidden: int, batch: int, seq: int, layers: int, bytes_per_value: float = ACT_BYTES
) -> float:
    """Bytes of activation checkpoints (h b s L values, 2 bytes each)."""
    return checkpoint_values(hidden, batch, seq, layers) * bytes_per_value


# --------------------------------------------------------------------------------------------
# The whole estimate as one dict (what --json prints)
# --------------------------------------------------------------------------------------------


def estimate(
    psi: float,
    gpus=DEFAULT_GPUS,
    k: float = DEFAULT_K,
    gpu_mem_gb: float | None = None,
    bandwidth_gb_s: float | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    checkpointing: bool = False,
    param_source: str = "params",
) -> dict:
    """Compute everything the command reports. Bytes are exact; ``*_gb`` are bytes / 1e9."""
    gpus = [int(n) for n in gpus]
    for n in gpus:
        check_psi_n(psi, n)

    activations = None
    act_used = 0.0
    if batch is not None and seq is not None and layers is not None and hidden is not None:
        full = activation_bytes(hidden, batch, seq, layers)
        ckpt = checkpoint_bytes(hidden, batch, seq, layers)
        act_used = ckpt if checkpointing else full
        activations = {
            "layers": layers,
            "hidden": hidden,
            "batch": batch,
            "seq": seq,
            "bytes_per_value": ACT_BYTES,
            "no_checkpointing_formula": "12*h*b*s*L values (paper §3.2 footnote)",
            "no_checkpointing_bytes": full,
            "no_checkpointing_gb": full / GB,
            "checkpointing_formula": "h*b*s*L values, one layer input per layer (paper §6.1)",
            "checkpointing_bytes": ckpt,
            "checkpointing_gb": ckpt / GB,
            "checkpointing": bool(checkpointing),
            "counted_in_fit_bytes": act_used,
        }

    capacity = None if gpu_mem_gb is None else gpu_mem_gb * GB - act_used
    rows = []
    for n in gpus:
        row = {"gpus": n, "bytes": {}, "gb": {}, "fits": {}}
        for s in STAGES:
            b = model_state_bytes(s, psi, n, k)
            key = f"stage{s}"
            row["bytes"][key] = b
            row["gb"][key] = b / GB
            row["fits"][key] = None if capacity is None else fits(b, capacity)
        rows.append(row)

    comm = {}
    for s in STAGES:
        entry = {
            "formula": COMM_FORMULAS[s],
            "elements": comm_elements(psi, s),
            "bytes": comm_bytes(psi, s),
            "gb": comm_bytes(psi, s) / GB,
            "seconds": None if bandwidth_gb_s is None else comm_seconds(psi, s, bandwidth_gb_s),
        }
        comm[f"stage{s}"] = entry

    report = {
        "params": psi,
        "param_source": param_source,
        "k": k,
        "bytes_per_param": PARAM_BYTES,
        "bytes_per_grad": GRAD_BYTES,
        "gb_bytes": GB,
        "stages": {
            f"stage{s}": {"name": STAGE_NAMES[s], "formula": STAGE_FORMULAS[s]} for s in STAGES
        },
        "gpus": gpus,
        "rows": rows,
        "gpu_mem_gb": gpu_mem_gb,
        "fit_counts": (
            None
            if gpu_mem_gb is None
            else "model states" + (" + activations" if activations else " only")
        ),
        "min_gpus_to_fit": (
            None
            if capacity is None
            else {f"stage{s}": min_gpus_to_fit(s, psi, capacity, k) for s in STAGES}
        ),
        "communication": {
            "bytes_per_element": COMM_BYTES,
            "bandwidth_gb_s": bandwidth_gb_s,
            "counting": COMM_NOTE,
            "stages": comm,
        },
        "activations": activations,
    }
    if layers is not None and hidden is not None:
        report["gpt_params_from_layers_hidden"] = gpt_params(layers, hidden)
    return report


# --------------------------------------------------------------------------------------------
# Text output
# --------------------------------------------------------------------------------------------


def fmt_gb(nbytes: float) -> str:
    """Paper-style GB, rounded half up as in Table 1: 120, 41.3, 31.4, 1.88, 0.469."""
    x = nbytes / GB
    if x >= 100:
        decimals = 0
    elif x >= 10:
        decimals = 1
    elif x >= 1:
        decimals = 2
    elif x >= 1e-3:
        decimals = 2 - math.floor(math.log10(x))  # 3 significant digits
    else:
        return f"{x:.3g}"
    q = Decimal(repr(x)).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP)
    return f"{q:f}"


def fmt_count(x: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if x >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:g}"


def fmt_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.1f} us"


def format_report(r: dict) -> str:
    k = r["k"]
    lines = []
    src = {"params": "from --params", "layers_hidden": "= 12*L*H^2 from --layers/--hidden"}
    lines.append("ZeRO-DP model states per GPU (paper §5.4, Table 1)")
    lines.append(
        f"  Psi = {r['params']:.4g} parameters ({fmt_count(r['params'])}, "
        f"{src.get(r['param_source'], r['param_source'])})"
    )
    if "gpt_params_from_layers_hidden" in r and r["param_source"] == "params":
        lines.append(
            f"  (12*L*H^2 from --layers/--hidden would give "
            f"{fmt_count(r['gpt_params_from_layers_hidden'])}; --params is used)"
        )
    lines.append(
        f"  bytes per parameter: {PARAM_BYTES} fp16/bf16 weights + {GRAD_BYTES} gradients "
        f"+ K = {k:g} optimizer state = {PARAM_BYTES + GRAD_BYTES + k:g}; GB = 1e9 bytes"
    )

    fits_on = r["gpu_mem_gb"] is not None
    head1 = ["GPUs"] + [STAGE_NAMES[s] for s in STAGES]
    head2 = [""] + [f"stage {s}" for s in STAGES]
    table = []
    for row in r["rows"]:
        cells = [str(row["gpus"])]
        for s in STAGES:
            key = f"stage{s}"
            cell = fmt_gb(row["bytes"][key])
            if fits_on:
                cell += " *" if row["fits"][key] else "  "
            cells.append(cell)
        table.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head1, head2, *table, strict=True)]
    widths = [max(w, 6) for w in widths]
    lines.append("")
    lines.append("  model-state GB per GPU")
    for cells in (head1, head2):
        lines.append("  " + "   ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    lines.append("  " + "   ".join("-" * w for w in widths))
    for cells in table:
        lines.append("  " + "   ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    lines.append(
        "  formulas: " + "; ".join(f"{STAGE_NAMES[s]} {STAGE_FORMULAS[s]}" for s in STAGES)
    )

    if fits_on:
        act = r["activations"]
        what = "model states only (activations, buffers and fragmentation not counted)"
        if act:
            which = "with checkpointing" if act["checkpointing"] else "without checkpointing"
            what = (
                f"model states + {fmt_gb(act['counted_in_fit_bytes'])} GB activations ({which}); "
                "buffers and fragmentation not counted"
            )
        lines.extend(_wrap(f"  * = fits in --gpu-mem {r['gpu_mem_gb']:g} GB: {what}", 96, "    "))
        parts = []
        for s in STAGES:
            m = r["min_gpus_to_fit"][f"stage{s}"]
            parts.append(f"{STAGE_NAMES[s]} {'never' if m is None else m}")
        line = "  fewest GPUs that fit: " + ", ".join(parts)
        if act and act["counted_in_fit_bytes"] >= r["gpu_mem_gb"] * GB:
            line += " (the activations alone exceed --gpu-mem)"
        lines.append(line)

    act = r["activations"]
    if act:
        lines.append("")
        lines.append(
            f"Activations per GPU (L={act['layers']}, h={act['hidden']}, micro-batch "
            f"b={act['batch']}, seq s={act['seq']}, {act['bytes_per_value']} bytes per value)"
        )
        lines.append(
            f"  without checkpointing: 12*h*b*s*L values (§3.2) = "
            f"{fmt_gb(act['no_checkpointing_bytes'])} GB"
        )
        lines.append(
            f"  with checkpointing:    h*b*s*L values (§6.1: one layer input per layer) = "
            f"{fmt_gb(act['checkpointing_bytes'])} GB"
        )
        lines.append(
            "    (checkpoints only: the layer being recomputed in backward needs its own full "
            "activations on top)"
        )

    c = r["communication"]
    bw = c["bandwidth_gb_s"]
    lines.append("")
    lines.append("Communication per training step (paper §7)")
    head = ["stage", "volume", "elements", f"bytes ({c['bytes_per_element']} B/elt)"]
    if bw is not None:
        head.append(f"time @ {bw:g} GB/s")
    rows = []
    for s in STAGES:
        e = c["stages"][f"stage{s}"]
        cells = [
            f"{STAGE_NAMES[s]} ({s})",
            e["formula"],
            f"{e['elements']:.4g}",
            f"{fmt_gb(e['bytes'])} GB",
        ]
        if bw is not None:
            cells.append(fmt_seconds(e["seconds"]))
        rows.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    lines.append("  " + "   ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    lines.append("  " + "   ".join("-" * w for w in widths))
    for cells in rows:
        lines.append("  " + "   ".join(x.ljust(w) for x, w in zip(cells, widths, strict=True)))
    lines.extend(_wrap("  " + COMM_NOTE, 96, "  "))
    return "\n".join(line.rstrip() for line in lines)


def _wrap(text: str, width: int, indent: str) -> list[str]:
    return textwrap.wrap(text, width=width, subsequent_indent=indent, break_on_hyphens=False)


# --------------------------------------------------------------------------------------------
# Plot (paper §5.4 chart)
# --------------------------------------------------------------------------------------------


class PlotUnavailable(RuntimeError):
    pass


def _import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed "
            f"({exc}). Install it with:  pip install matplotlib   "
            "(or: pip install 'zerokern[plot]'), or drop --plot."
        ) from exc
    return plt


def plot_memory(report: dict, path: str, plt=None) -> None:
    """Memory per GPU vs number of GPUs, log-log, one curve per stage, a line at --gpu-mem.

    Writes to a temporary file next to ``path`` and renames it, so a failure leaves no
    half-written image behind.
    """
    if plt is None:
        plt = _import_pyplot()
    psi, k = report["params"], report["k"]
    asked = sorted(set(report["gpus"]))
    top = max(max(asked), 2)
    xs = sorted({2**i for i in range(int(math.log2(top)) + 1)} | set(asked) | {top})
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for s in STAGES:
            ys = [model_state_bytes(s, psi, n, k) / GB for n in xs]
            (line,) = ax.plot(xs, ys, label=f"{STAGE_NAMES[s]} (stage {s})")
            ax.plot(
                asked,
                [model_state_bytes(s, psi, n, k) / GB for n in asked],
                "o",
                color=line.get_color(),
                markersize=4,
            )
        if report["gpu_mem_gb"] is not None:
            ax.axhline(
                report["gpu_mem_gb"],
                color="purple",
                linestyle="--",
                label=f"GPU memory {report['gpu_mem_gb']:g} GB",
            )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.set_yscale("log")
        ax.set_xlabel("data-parallel GPUs N")
        ax.set_ylabel("model-state memory per GPU (GB = 1e9 B)")
        ax.set_title(f"ZeRO-DP model states per GPU, Psi = {fmt_count(psi)}, K = {k:g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
        directory = os.path.dirname(os.path.abspath(path))
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
        try:
            fig.savefig(tmp, format=fmt)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    finally:
        plt.close(fig)


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
    "memory. GB = 1e9 bytes. Example: --params 7.5e9 --gpus 1 4 16 64 256 1024 --gpu-mem 32"
)


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
        default=DEFAULT_K,
        metavar="K",
        help="optimizer-state bytes per parameter (default 12: mixed-precision Adam)",
    )
    p.add_argument(
        "--gpu-mem",
        type=_positive_float,
        metavar="GB",
        help="memory per GPU in GB (1e9 bytes); marks what fits and the fewest GPUs that fit",
    )
    p.add_argument(
        "--bandwidth",
        type=_positive_float,
        metavar="GB/s",
        help="per-GPU link bandwidth in GB/s, to turn communication volume into time",
    )
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


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``estimate`` on a dispatcher's ``add_subparsers()`` object."""
    p = subparsers.add_parser("estimate", help=HELP, description=DESCRIPTION)
    return configure_parser(p)


def _validate(args) -> str | None:
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
    return None


def run(args) -> int:
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
    )

    # Do the plot (the only step that can fail) before printing anything.
    if args.plot:
        try:
            plt = _import_pyplot()
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
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 0


def main(argv=None) -> int:
    """Standalone entry point: ``python -m zerokern.cli.estimate ...``."""
    parser = configure_parser(
        argparse.ArgumentParser(prog="zerokern estimate", description=DESCRIPTION)
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
