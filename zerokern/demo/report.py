"""The demo's table: measured against the paper's formulas, as text, CSV and a PNG chart.

Checks (each one makes ``python -m zerokern demo`` exit 1 when it fails):
* final losses of all trained policies agree within a relative tolerance;
* on every rank, params + grads + the optimizer state's kinds + padding (memory_stats) equals
  the paper's formula at the padded Psi with the K of the state format, or that plus
  zerokern's known extra buffers (``zerokern_extra_bytes``; the table names them). A
  compressed bar's extra is the fp32 side moments of parameters too small to compress: per
  rank what memory_stats() reports, and over all ranks exactly 8 bytes per element of those
  parameters, counted from their sizes;
* on every rank, comm_stats()["elements"] of the last step equals 2 Psi (stages 0-2) or 3 Psi
  (stage 3), Psi padded as zerokern shards it (trained policies; a compressed bar sends
  nothing).
"""

from __future__ import annotations

import csv
import os
import textwrap

from ..formulas import (
    MIN_COMPRESSED_NUMEL,
    STAGE_NAMES,
    expected_comm_elements,
    expected_model_state_bytes,
    k_formula_text,
    optimizer_bytes_per_param,
    state_formula_text,
    zerokern_extra_bytes,
)

__all__ = ["LOSS_RTOL", "build_rows", "format_table", "write_csv", "write_losses_csv", "write_png"]

OPTIMIZER_KINDS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax",
                   "exp_avg_side", "exp_avg_sq_side")
STATE_KINDS = ("params", "grads", *OPTIMIZER_KINDS)
SIDE_KINDS = ("exp_avg_side", "exp_avg_sq_side")
SIDE_WHAT = f"fp32 moments of parameters under {MIN_COMPRESSED_NUMEL:,} elements"
# Max relative difference allowed between policies' final losses. With gloo on CPU the
# policies are bit-identical in practice; NCCL sums in other orders, and in bf16 one rounding
# step of a parameter already moves the loss by ~1e-3.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}


def _state_bytes(mem: dict) -> int:
    return sum(mem.get(k, 0) for k in STATE_KINDS)


def _side_bytes(mem: dict) -> int:
    return sum(mem.get(k, 0) for k in SIDE_KINDS)


def _fmt(r: dict) -> tuple[str, str]:
    return r.get("moments", "fp32"), r.get("master", "fp32")


def policy_name(r: dict) -> str:
    """'2 P_os+g', or for a compressed bar '3 P_os+g+p int8' / '3 P_os+g+p int8, no master'."""
    moments, master = _fmt(r)
    name = STAGE_NAMES[r["stage"]]
    if (moments, master) != ("fp32", "fp32"):
        name += f" {moments}" + (" moments" if moments == "fp32" else "")
        name += ", no master" if master == "none" else ""
    return name


def _memory_check(r: dict) -> tuple[str, int | float, dict[str, int]]:
    """(check, formula bytes, the extra bytes used, by what) of one record, every rank."""
    stage, world, p = r["stage"], r["world"], r["param_bytes"]
    moments, master = _fmt(r)
    psi_pad = r["psi_padded"]
    formula = expected_model_state_bytes(stage, psi_pad, world, p, moments, master)
    per_rank = [_state_bytes(m) + m["padding"] for m in r["memory_by_rank"]]
    sides = [_side_bytes(m) for m in r["memory_by_rank"]]
    if moments != "fp32":
        # The side moments, rank by rank as reported, and in all exactly 8 bytes per element
        # of the small parameters (each held once; by every rank at stage 0).
        held = r["small_numel"] * (world if stage == 0 else 1)
        if sum(sides) == 8 * held and all(
                t == formula + sd for t, sd in zip(per_rank, sides, strict=True)):
            return "= formula + extra", formula, {SIDE_WHAT: sides[0]}
        return "MISMATCH", formula, {}
    extra = zerokern_extra_bytes(stage, psi_pad, world, p)
    if any(sides):
        return "MISMATCH", formula, {}
    if all(t == formula for t in per_rank):
        return "= formula", formula, {}
    if extra and all(t == formula + sum(extra.values()) for t in per_rank):
        return "= formula + extra", formula, extra
    return "MISMATCH", formula, {}


def build_rows(results: list[dict], precision: str, rtol: float) -> tuple[list[dict], dict]:
    """One row per policy and per compressed bar, and a summary {'loss_max_rel_diff',
    'loss_ok', 'ok', ...}; the loss and communication checks cover the trained policies."""
    rows = []
    for r in results:
        stage, world, p = r["stage"], r["world"], r["param_bytes"]
        moments, master = _fmt(r)
        trained = r.get("trained", True)
        psi_pad = r["psi_padded"]
        state_check, formula, extra_used = _memory_check(r)
        comm_formula = expected_comm_elements(stage, psi_pad, world)
        comm_ok = all(c == comm_formula for c in r["comm_by_rank"])
        mem = r["memory"]
        rows.append(
            {
                "stage": stage,
                "policy": policy_name(r),
                "precision": precision,
                "moments": moments,
                "master": master,
                "trained": trained,
                "world_size": world,
                "psi": r["psi"],
                "psi_padded": psi_pad,
                "final_loss": r["losses"][-1] if trained else "",
                "k": optimizer_bytes_per_param(p, moments, master),
                "k_formula": k_formula_text(moments, master, p),
                "state_measured_bytes": _state_bytes(mem),
                "padding_bytes": mem["padding"],
                "state_formula": state_formula_text(stage, p, moments, master),
                "state_formula_bytes": formula,
                "state_extra_bytes": sum(extra_used.values()),
                "state_extra_what": "; ".join(f"{k} {_mb(v)}" for k, v in extra_used.items()),
                "state_check": state_check,
                **{f"{k}_bytes": mem.get(k, 0) for k in STATE_KINDS},
                "bucket_bytes": mem.get("buckets", 0),
                "comm_scratch_bytes": mem.get("comm_scratch", 0),
                "comm_measured_elements": r["comm_elements"],
                "comm_formula": (("0 (one rank)" if world == 1 else ("3Ψ" if stage == 3 else "2Ψ"))
                                 if trained else "not stepped"),
                "comm_formula_elements": comm_formula if trained else "",
                "comm_check": ("= formula" if comm_ok else "MISMATCH") if trained else "",
                "step_ms_median": round(r["step_ms_median"], 1) if trained else "",
                "steps": len(r["losses"]),
            }
        )
    finals = [row["final_loss"] for row in rows if row["trained"]]
    lo, hi = min(finals), max(finals)
    rel = (hi - lo) / abs(lo) if lo else float(hi != lo)
    summary = {
        "loss_max_rel_diff": rel,
        "loss_rtol": rtol,
        "loss_ok": rel <= rtol,
        "state_ok": all(row["state_check"] != "MISMATCH" for row in rows),
        "comm_ok": all(row["comm_check"] != "MISMATCH" for row in rows),
    }
    summary["ok"] = summary["loss_ok"] and summary["state_ok"] and summary["comm_ok"]
    return rows, summary


def _mb(x: float) -> str:
    return f"{x / 1e6:.3f} MB"


def format_table(rows: list[dict], summary: dict) -> str:
    """A Markdown table (readable in a terminal, pasteable into the README) and the checks."""
    head = [
        "stage",
        "final loss",
        "Ψ padded",
        "model states / rank: measured (+ padding)",
        "formula",
        "check",
        "elements / step: measured",
        "formula",
        "check",
        "step ms (median)",
    ]
    body = []
    for r in rows:
        extra = f" + {_mb(r['state_extra_bytes'])} extra" if r["state_extra_bytes"] else ""
        trained = r["trained"]
        body.append(
            [
                f"{r['stage']} {r['policy']}",
                f"{r['final_loss']:.6f}" if trained else "-",
                f"{r['psi_padded']:,}",
                f"{_mb(r['state_measured_bytes'])} (+ {_mb(r['padding_bytes'])})",
                f"{r['state_formula']} = {_mb(r['state_formula_bytes'])}{extra}",
                "ok" if r["state_check"] != "MISMATCH" else "MISMATCH",
                f"{r['comm_measured_elements']:,}" if trained else "-",
                f"{r['comm_formula']} = {r['comm_formula_elements']:,}" if trained else "-",
                ("ok" if r["comm_check"] != "MISMATCH" else "MISMATCH") if trained else "-",
                f"{r['step_ms_median']:.0f}" if trained else "-",
            ]
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    right = {1, 2, 3, 6, 9}

    def line(cells: list[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "| " + " | ".join(out) + " |"

    sep = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)
        )
        + "|"
    )
    lines = [line(head), sep, *(line(b) for b in body)]
    r0 = rows[0]
    n = r0["world_size"]
    lines.append("")
    lines.append(
        f"Ψ = {r0['psi']:,} parameters; the formulas use Ψ as zerokern pads it (stages 0-2: "
        f"bucket rounding, stage 3: per block), N = {n} rank{'s' if n > 1 else ''}, "
        f"{r0['precision']} parameters "
        f"(K = {12 if r0['precision'] == 'bf16' else 8} bytes of optimizer state per "
        f"parameter). MB = 1e6 bytes."
    )
    for r in rows:
        if not r["trained"]:
            lines.append(
                f"{r['stage']} {r['policy']}: ZeroAdamW(moments={r['moments']!r}, "
                f"master={r['master']!r}), memory only (built, not trained: stage "
                f"{r['stage']} allocates its state with the optimizer); K = {r['k_formula']}"
            )
    for r in rows:
        if r["state_extra_bytes"] and not r["trained"]:
            lines.append(
                f"{r['stage']} {r['policy']}: extra = {SIDE_WHAT} on rank 0 "
                f"({_mb(r['state_extra_bytes'])}; on all ranks together 8 bytes per element "
                f"of those parameters)"
            )
        elif r["state_extra_bytes"]:
            lines.append(
                f"stage {r['stage']}: zerokern holds more than the paper: {r['state_extra_what']}"
            )
        if r["bucket_bytes"]:
            lines.append(
                f"stage {r['stage']} also holds {_mb(r['bucket_bytes'])} of gradient "
                f"buckets (the paper's constant buffer, not a model state)"
            )
        if r["comm_scratch_bytes"]:
            lines.append(
                f"stage {r['stage']} also held at most {_mb(r['comm_scratch_bytes'])} of "
                f"receive buffers in flight (gloo's point-to-point reduce-scatter, not a model "
                f"state)"
            )
    verdict = "equal" if summary["loss_ok"] else "NOT equal"
    lines.append(
        f"final losses: {verdict} within relative tolerance {summary['loss_rtol']:g} "
        f"(max relative difference {summary['loss_max_rel_diff']:.3g})"
    )
    lines.append(
        "memory vs formula: "
        + ("all match" if summary["state_ok"] else "MISMATCH")
        + "; communication vs formula: "
        + ("all match" if summary["comm_ok"] else "MISMATCH")
        + " (checked on every rank; measured columns: rank 0)"
    )
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_losses_csv(results: list[dict], path: str) -> None:
    """Every trained policy's loss at every step (the compressed bars are not trained)."""
    results = [r for r in results if r.get("trained", True)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + [f"stage{r['stage']}" for r in results])
        for i in range(len(results[0]["losses"])):
            w.writerow([i] + [repr(r["losses"][i]) for r in results])


def write_png(rows: list[dict], results: list[dict], path: str, title: str) -> str | None:
    """The chart; returns None, or why it was not written (no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or zerokern[plot])"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    labels = [f"{r['stage']}\n{r['policy']}".replace(" ", "\n", 1).replace(",", "")
              for r in rows]
    xs = range(len(rows))
    ax = axes[0]
    bottom = [0.0] * len(rows)
    parts = [
        ("params", ["params_bytes"]),
        ("grads", ["grads_bytes"]),
        ("optimizer state", [f"{k}_bytes" for k in OPTIMIZER_KINDS]),
        ("padding", ["padding_bytes"]),
    ]
    for name, keys in parts:
        vals = [sum(r[k] for k in keys) / 1e6 for r in rows]
        ax.bar([x - 0.2 for x in xs], vals, 0.4, bottom=bottom, label=f"measured: {name}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar(
        [x + 0.2 for x in xs],
        [r["state_formula_bytes"] / 1e6 for r in rows],
        0.4,
        color="white",
        edgecolor="black",
        hatch="//",
        label="paper formula",
    )
    with_extra = [(x, r) for x, r in zip(xs, rows) if r["state_extra_bytes"]]
    if with_extra:
        ax.bar(
            [x + 0.2 for x, _ in with_extra],
            [r["state_extra_bytes"] / 1e6 for _, r in with_extra],
            0.4,
            bottom=[r["state_formula_bytes"] / 1e6 for _, r in with_extra],
            color="white",
            edgecolor="red",
            hatch="..",
            label="zerokern extra",
        )
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("model states per rank (MB)")
    ax.set_title("memory per rank")
    ax.legend(fontsize=7)
    ax = axes[1]
    rows = [r for r in rows if r["trained"]]  # a compressed bar sends nothing
    labels = [f"{r['stage']}\n{r['policy']}" for r in rows]
    xs = range(len(rows))
    ax.bar(
        [x - 0.2 for x in xs],
        [r["comm_measured_elements"] / 1e6 for r in rows],
        0.4,
        label="measured (comm_stats)",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [r["comm_formula_elements"] / 1e6 for r in rows],
        0.4,
        color="white",
        edgecolor="black",
        hatch="//",
        label="2Ψ / 3Ψ",
    )
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("elements per step (millions)")
    ax.set_title("communication per step")
    ax.legend(fontsize=7)
    ax = axes[2]
    results = [r for r in results if r.get("trained", True)]
    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(results):
        ax.plot(
            r["losses"],
            styles[i % 4],
            lw=1.5 + 0.7 * (len(results) - i),
            label=f"stage {r['stage']} {STAGE_NAMES[r['stage']]}",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / character)")
    ax.set_title("loss (curves overlap: same numerics)")
    ax.legend(fontsize=7)
    fig.suptitle("\n".join(textwrap.wrap(title, 180)), fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
