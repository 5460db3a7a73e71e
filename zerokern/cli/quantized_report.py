"""The quantized-communication table of ``python -m zerokern estimate``: the text of
``report["quantized"]`` (:func:`zerokern.quantized_plan.quantized_plan`)."""

from __future__ import annotations

from typing import Any

from .estimate_report import fmt_gb, fmt_seconds

NOTE = (
    "Per GPU and step: bytes one GPU sends over an intra-node and over an inter-node link "
    "(ring-exact, scales and padding included: zerokern.formulas' quantized_*_bytes), the "
    "inter-node bytes in 16-bit elements as a multiple of Psi (ZeRO++ counts ZeRO-3's as 3 "
    "Psi), and the communication seconds of the step at each inter-node speed (comm_model's "
    "ring model, collectives one after another, no overlap with compute). flat: every "
    "collective over all GPUs; hybrid: sharded within a node, replicated across; hpz: sharded "
    "over all GPUs, the backward's gathers in the node from a secondary 16-bit copy (hpZ "
    "copy: its bytes per GPU, zerokern.formulas.hpz_secondary_bytes)."
)


def wire_name(gather_dtype: str | None, reduce_dtype: str | None) -> str:
    """'16-bit', 'gather int8', 'reduce int4', 'gather int8 + reduce int4'."""
    parts = ([f"gather {gather_dtype}"] if gather_dtype else []) + (
        [f"reduce {reduce_dtype}"] if reduce_dtype else [])
    return " + ".join(parts) or "16-bit"


def format_quantized(q: dict[str, Any]) -> str:
    """The table: one row per layout, stage and wire format."""
    speeds = [f"{g:g}" for g in q["inter_gbits"]]
    hpz = "hpz" in q["layouts"]  # the secondary copy's column only beside an hpZ row
    head = ["layout", "stage", "wire", "intra GB/GPU", "inter GB/GPU", "inter x Psi",
            *(["hpZ copy GB/GPU"] if hpz else []), *(f"t @ {s} Gb/s" for s in speeds)]
    rows = [head]
    for layout, items in q["layouts"].items():
        for r in items:
            rows.append([layout, "3" if r["stage"] == 3 else "1-2",
                         wire_name(r["gather_dtype"], r["reduce_dtype"]),
                         fmt_gb(r["intra_bytes"]), fmt_gb(r["inter_bytes"]),
                         f"{r['inter_vs_psi']:.3f}",
                         *([fmt_gb(r["secondary_bytes"]) if layout == "hpz" else "-"]
                           if hpz else []),
                         *(fmt_seconds(r["seconds_by_inter_gbits"][s]) for s in speeds)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [f"Quantized communication per step, {q['nodes']} nodes x {q['gpus_per_node']} "
             f"GPUs, {q['params']:,} parameters (intra-node link {q['intra_bw_gb_s']:g} GB/s)"]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if j < 3 else c.rjust(w)
                               for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join([*lines, "", NOTE])
