"""The text report and the chart of ``python -m zerokern estimate``: turns the dict that
:func:`zerokern.estimate.estimate` returns into the printed tables (paper-style GB, as in
Table 1) and, for ``--plot``, the §5.4 chart. matplotlib is imported only when a chart is drawn,
so the command starts fast without it.
"""

from __future__ import annotations

import math
import os
import textwrap
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from ..formulas import GB, STAGE_NAMES, STAGES, model_state_bytes

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
    """A count with a 3-significant-digit K/M/B/T suffix: 7.5e9 -> '7.5B'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if x >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:g}"


def fmt_seconds(t: float) -> str:
    """A duration in s, ms or us, whichever keeps it readable: 0.3 -> '300.0 ms'."""
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.1f} us"


def format_report(r: dict[str, Any]) -> str:
    """The human-readable report of an ``estimate(...)`` dict: memory table, fit marks,
    activations and communication, with no trailing spaces on any line."""
    # Byte widths and stage formulas are read from the dict, so the text shows what --json says.
    k, p_bytes, g_bytes = r["k"], r["bytes_per_param"], r["bytes_per_grad"]
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
        f"  bytes per parameter: {p_bytes} fp16/bf16 weights + {g_bytes} gradients "
        f"+ K = {k:g} optimizer state = {p_bytes + g_bytes + k:g}; GB = 1e9 bytes"
    )
    if r.get("moments", "fp32") != "fp32" or r.get("master", "fp32") != "fp32":
        lines.append(
            f"  optimizer state: moments={r['moments']}, master={r['master']}: "
            f"K = {r['k_formula']}"
        )
        if r.get("state_note"):
            lines.extend(_wrap("  " + r["state_note"], 96, "  "))

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
        "  formulas: " + "; ".join(f"{st['name']} {st['formula']}" for st in r["stages"].values())
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

    lines.extend(_offload_lines(r))

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
    lines.extend(_wrap("  " + c["counting"], 96, "  "))
    lines.extend(_cluster_lines(r))
    if r.get("muon"):
        from ..estimate_muon import format_muon

        lines.extend(format_muon(r["muon"]))
    return "\n".join(line.rstrip() for line in lines)


def _link_text(link: dict[str, float]) -> str:
    return f"{link['bandwidth_gb_s']:g} GB/s, {link['latency_s'] * 1e6:g} us"


def _cluster_lines(r: dict[str, Any]) -> list[str]:
    """The across-nodes table: per stage and layout, memory per GPU, what one intra-node and
    one inter-node link carry per step, and the step's communication time."""
    c = r.get("cluster")
    if not c:
        return []
    lines = ["", f"Across nodes: {c['nodes']} nodes x {c['gpus_per_node']} GPUs = {c['world']} "
             f"ranks, per step ({c['bytes_per_element']} B/element)"]
    lines.extend(_wrap(f"  links per GPU: intra-node {_link_text(c['intra'])}; inter-node "
                       f"{_link_text(c['inter'])} (bandwidth per direction, latency per ring "
                       "step)", 96, "    "))
    lines.append(f"  buckets of {c['bucket_numel']:,} elements: {c['calls_per_collective']:,} "
                 "calls per collective")
    marks = r["gpu_mem_gb"] is not None
    head = ["stage", "layout", "GB/GPU", "intra el / GB", "inter el / GB",
            "comm time", "inter part"]
    rows = []
    for s in STAGES:
        for name, lay in c["layouts"].items():
            e = lay["stages"][f"stage{s}"]
            what = (f"flat, N={lay['shard_ranks']}" if name == "flat" else
                    f"hybrid, N={lay['shard_ranks']} x{lay['replicate_ranks']}")
            traffic = [f"{fmt_count(t['elements'])} / {fmt_gb(t['bytes'])}" if t["bytes"]
                       else "0" for t in (e["traffic"]["intra"], e["traffic"]["inter"])]
            mem = fmt_gb(e["memory_bytes"]) + ((" *" if e["fits"] else "  ") if marks else "")
            first = name == next(iter(c["layouts"]))
            rows.append([f"{STAGE_NAMES[s]} ({s})" if first else "", what, mem, *traffic,
                         fmt_seconds(e["seconds"]),
                         fmt_seconds(e["seconds_by_link"]["inter"])])
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    for cells in (head, ["-" * w for w in widths], *rows):
        lines.append("  " + "  ".join(x.ljust(w) for x, w in zip(cells, widths, strict=True)))
    if marks:
        lines.append(f"  * = model states fit in --gpu-mem {r['gpu_mem_gb']:g} GB")
    lines.extend(_wrap("  intra / inter el / GB: elements and GB (1e9 bytes) one intra-node "
                       "/ inter-node link carries per step. N: ranks the sharded state is "
                       "divided over (hybrid: a node's GPUs, x the nodes it is replicated on). "
                       + c["model"], 96, "  "))
    return lines


def _offload_lines(r: dict[str, Any]) -> list[str]:
    """The ZeRO-Offload table: device / host GB per rank of each variant."""
    off = r.get("offload")
    if not off:
        return []
    variants = list(off["variants"])
    marks = r["gpu_mem_gb"] is not None or off["host_mem_gb"] is not None
    head = ["GPUs"] + [off["variants"][v]["name"] for v in variants]
    table = []
    for row in off["rows"]:
        cells = [str(row["gpus"])]
        for v in variants:
            cell = f"{fmt_gb(row['device_bytes'][v])} / {fmt_gb(row['host_bytes'][v])}"
            if marks:
                cell += " *" if row["fits"][v] else "  "
            cells.append(cell)
        table.append(cells)
    widths = [max(max(len(x) for x in col), 6) for col in zip(head, *table, strict=True)]
    lines = ["", "  ZeRO-Offload: device GB / host GB per GPU (offload='cpu')"]
    lines.append("  " + "   ".join(c.rjust(w) for c, w in zip(head, widths, strict=True)))
    lines.append("  " + "   ".join("-" * w for w in widths))
    for cells in table:
        lines.append("  " + "   ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    lines.extend(_wrap("  formulas (device / host): " + "; ".join(
        f"{d['name']} {d['device_formula']} / {d['host_formula']}"
        for d in off["variants"].values()), 96, "    "))
    if off.get("host_k_formula"):
        ks = ", ".join(f"{d['name']} {d['k']:g}" for d in off["variants"].values())
        lines.extend(_wrap(f"  K on the host: {off['host_k_formula']} (master='none': the "
                           f"CPU step updates a bf16 copy of the shard; {ks})", 96, "    "))
    if marks:
        budget = []
        if r["gpu_mem_gb"] is not None:
            budget.append(f"--gpu-mem {r['gpu_mem_gb']:g} GB")
        if off["host_mem_gb"] is not None:
            budget.append(f"--host-mem {off['host_mem_gb']:g} GB")
        lines.append(f"  * = fits in {' and '.join(budget)}")
        lines.append("  fewest GPUs that fit: " + ", ".join(
            f"{off['variants'][v]['name']} {'never' if m is None else m}"
            for v, m in off["min_gpus_to_fit"].items()))
    lines.extend(_wrap("  " + off["note"], 96, "  "))
    return lines


def _wrap(text: str, width: int, indent: str) -> list[str]:
    # hyphenated terms like "reduce-scatter" and "all-gather" must stay on one line
    return textwrap.wrap(text, width=width, subsequent_indent=indent, break_on_hyphens=False)


# --------------------------------------------------------------------------------------------
# Plot (paper §5.4 chart)
# --------------------------------------------------------------------------------------------


class PlotUnavailable(RuntimeError):
    """matplotlib is missing; the message says how to install it or drop ``--plot``."""


def import_pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend, imported only here (on demand), so the
    CLI can fail before printing anything when it is missing."""
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


def plot_memory(report: dict[str, Any], path: str, plt: Any = None) -> None:
    """Memory per GPU vs number of GPUs, log-log, one curve per stage, a line at --gpu-mem.

    Writes to a temporary file next to ``path`` and renames it, so a failure leaves no
    half-written image behind.
    """
    if plt is None:
        plt = import_pyplot()
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
        fmt = ""
        if report.get("moments", "fp32") != "fp32" or report.get("master", "fp32") != "fp32":
            fmt = f" ({report['moments']} moments, master {report['master']})"
        ax.set_title(f"ZeRO-DP model states per GPU, Psi = {fmt_count(psi)}, K = {k:g}{fmt}")
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
