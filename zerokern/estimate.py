"""Everything ``python -m zerokern estimate`` reports, as one dict of numbers (what ``--json``
prints). Pure arithmetic on top of :mod:`zerokern.formulas`: no printing, no argparse, no torch,
so the CLI, its text report and the tests share one computation.

Bytes are exact; every ``*_gb`` value is bytes / 1e9, the paper's GB.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .formulas import (
    ACT_BYTES,
    COMM_BYTES,
    COMM_FORMULAS,
    GB,
    GRAD_BYTES,
    MIN_COMPRESSED_NUMEL,
    OFFLOAD_FORMULAS,
    OFFLOAD_NAMES,
    OFFLOAD_VARIANTS,
    PARAM_BYTES,
    STAGE_FORMULAS,
    STAGE_NAMES,
    STAGES,
    activation_bytes,
    check_psi_n,
    checkpoint_bytes,
    comm_bytes,
    comm_elements,
    comm_seconds,
    fits,
    gpt_params,
    k_formula_text,
    min_gpus_to_fit,
    model_state_bytes,
    offload_bytes,
    offload_k,
    offload_min_gpus_to_fit,
    optimizer_bytes_per_param,
    optimizer_state_parts,
)

DEFAULT_GPUS = (1, 4, 16, 64, 256, 1024)  # the N_d rows of the paper's Table 1

# Kept in the dict (not only in the text report) so a --json reader knows what "bytes" means.
COMM_NOTE = (
    "Counted as the paper's §7 counts it: the data volume of the step's collectives "
    "(DP and stages 1-2: reduce-scatter + all-gather = 2*Psi; stage 3: all-gather in forward "
    "+ all-gather in backward + gradient reduce-scatter = 3*Psi). With ring algorithms each "
    "GPU sends, and receives, about this volume ((N-1)/N of it exactly; nothing at N = 1), "
    "so time = bytes / per-GPU link bandwidth, ignoring latency and overlap with compute."
)


def _activations(
    layers: int, hidden: int, batch: int, seq: int, checkpointing: bool
) -> dict[str, Any]:
    """The activation section: both variants, and which one counts against --gpu-mem."""
    full = activation_bytes(hidden, batch, seq, layers)
    ckpt = checkpoint_bytes(hidden, batch, seq, layers)
    return {
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
        "counted_in_fit_bytes": ckpt if checkpointing else full,
    }


def _memory_row(psi: float, n: int, k: float, capacity: float | None) -> dict[str, Any]:
    """One table row: model-state bytes per GPU of every stage on ``n`` GPUs, and what fits."""
    row: dict[str, Any] = {"gpus": n, "bytes": {}, "gb": {}, "fits": {}}
    for s in STAGES:
        b = model_state_bytes(s, psi, n, k)
        key = f"stage{s}"
        row["bytes"][key] = b
        row["gb"][key] = b / GB
        row["fits"][key] = None if capacity is None else fits(b, capacity)
    return row


OFFLOAD_NOTE = (
    "ZeRO-Offload (offload='cpu'): the rank's optimizer state (fp32 master, or a bf16 copy of "
    "the shard with master='none'; moments) and gradient shard in host memory, the step on "
    "the CPU; '+off params' also keeps stage 3's parameter shard there "
    "(shard_model(offload_params=True)). Model states only: the constant device buffers "
    "(gradient buckets, gathered units) and the two host staging slots come on top."
)


def _offload(psi: float, gpus: list[int], ks: dict[str, float], capacity: float | None,
             host_capacity: float | None) -> dict[str, Any]:
    """Device and host bytes per rank of every offload variant (``ks``: each one's K on the
    host), and what fits."""
    rows = []
    for n in gpus:
        row: dict[str, Any] = {"gpus": n, "device_bytes": {}, "host_bytes": {}, "fits": {}}
        for v in OFFLOAD_VARIANTS:
            dev, host = offload_bytes(v, psi, n, ks[v])
            row["device_bytes"][v], row["host_bytes"][v] = dev, host
            ok_dev = None if capacity is None else fits(dev, capacity)
            ok_host = None if host_capacity is None else fits(host, host_capacity)
            row["fits"][v] = (None if ok_dev is None and ok_host is None
                              else (ok_dev is not False) and (ok_host is not False))
        rows.append(row)
    return {
        "variants": {v: {"name": OFFLOAD_NAMES[v], "device_formula": OFFLOAD_FORMULAS[v][0],
                         "host_formula": OFFLOAD_FORMULAS[v][1], "k": ks[v]}
                     for v in OFFLOAD_VARIANTS},
        "rows": rows,
        "host_mem_gb": None if host_capacity is None else host_capacity / GB,
        "min_gpus_to_fit": (
            None if capacity is None and host_capacity is None else {
                v: offload_min_gpus_to_fit(v, psi, math.inf if capacity is None else capacity,
                                           host_capacity, ks[v])
                for v in OFFLOAD_VARIANTS}),
        "note": OFFLOAD_NOTE,
    }


def _communication(psi: float, bandwidth_gb_s: float | None) -> dict[str, Any]:
    """Per-step volume of every stage (paper §7), and its time when a bandwidth is given."""
    stages = {
        f"stage{s}": {
            "formula": COMM_FORMULAS[s],
            "elements": comm_elements(psi, s),
            "bytes": comm_bytes(psi, s),
            "gb": comm_bytes(psi, s) / GB,
            "seconds": None if bandwidth_gb_s is None else comm_seconds(psi, s, bandwidth_gb_s),
        }
        for s in STAGES
    }
    return {
        "bytes_per_element": COMM_BYTES,
        "bandwidth_gb_s": bandwidth_gb_s,
        "counting": COMM_NOTE,
        "stages": stages,
    }


STATE_NOTE = (
    "K is the state of a parameter of at least {n:,} elements; smaller ones (biases, norms) "
    "keep fp32 moments: 8 bytes more each, a negligible share of a large model."
)


def _state(k: float | None, moments: str, master: str) -> dict[str, Any]:
    """The optimizer-state format and its K (``k`` None: the format's, else ``k`` as given
    for the default format)."""
    default = moments == "fp32" and master == "fp32"
    if k is not None and not default:
        raise ValueError(f"give k or moments/master, not both: k={k!r} with moments={moments!r}, "
                         f"master={master!r} (the format decides K)")
    parts = optimizer_state_parts(moments, master)  # ValueError naming moments or master
    if k is not None:
        if not (k >= 0 and math.isfinite(k)):
            raise ValueError(f"k must be a finite number >= 0, got {k!r}")
        return {"k": k, "moments": moments, "master": master, "k_parts": None,
                "k_formula": "given", "offload_k": dict.fromkeys(OFFLOAD_VARIANTS, k),
                "note": None}
    return {
        "k": optimizer_bytes_per_param(PARAM_BYTES, moments, master),
        "moments": moments,
        "master": master,
        "k_parts": {name: float(v) for name, v in parts.items()},
        "k_formula": k_formula_text(moments, master),
        "offload_k": {v: offload_k(v, moments, master) for v in OFFLOAD_VARIANTS},
        "note": None if default else STATE_NOTE.format(n=MIN_COMPRESSED_NUMEL),
    }


def estimate(
    psi: float,
    gpus: Iterable[int] = DEFAULT_GPUS,
    k: float | None = None,
    gpu_mem_gb: float | None = None,
    bandwidth_gb_s: float | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    checkpointing: bool = False,
    param_source: str = "params",
    host_mem_gb: float | None = None,
    moments: str = "fp32",
    master: str = "fp32",
) -> dict[str, Any]:
    """Compute everything the command reports. Bytes are exact; ``*_gb`` are bytes / 1e9.

    K, the optimizer-state bytes per parameter, is the state format's (``moments`` "fp32" |
    "bf16" | "int8", ``master`` "fp32" | "none", as ``ZeroAdamW`` takes them; the default is
    the paper's 12), or ``k`` for the default format (a format and ``k`` together: ValueError).
    With ``master="none"`` the offload rows hold a bf16 copy of the shard on the host (K + 2).

    Activations are computed only when ``layers``, ``hidden``, ``batch`` and ``seq`` are all
    given; then the chosen variant (``checkpointing``) is subtracted from ``gpu_mem_gb`` before
    deciding what fits. ``param_source`` only labels where ``psi`` came from.
    ``host_mem_gb``: host memory per rank for the offload rows (None: not limited).
    """
    gpus = [int(n) for n in gpus]
    for n in gpus:
        check_psi_n(psi, n)
    state = _state(k, moments, master)
    k = state["k"]

    activations = None
    if batch is not None and seq is not None and layers is not None and hidden is not None:
        activations = _activations(layers, hidden, batch, seq, checkpointing)
    act_used = 0.0 if activations is None else activations["counted_in_fit_bytes"]
    capacity = None if gpu_mem_gb is None else gpu_mem_gb * GB - act_used

    report: dict[str, Any] = {
        "params": psi,
        "param_source": param_source,
        "k": k,
        "moments": state["moments"],
        "master": state["master"],
        "k_parts": state["k_parts"],
        "k_formula": state["k_formula"],
        "state_note": state["note"],
        "bytes_per_param": PARAM_BYTES,
        "bytes_per_grad": GRAD_BYTES,
        "gb_bytes": GB,
        "stages": {
            f"stage{s}": {"name": STAGE_NAMES[s], "formula": STAGE_FORMULAS[s]} for s in STAGES
        },
        "gpus": gpus,
        "rows": [_memory_row(psi, n, k, capacity) for n in gpus],
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
        "communication": _communication(psi, bandwidth_gb_s),
        "offload": _offload(psi, gpus, state["offload_k"], capacity,
                            None if host_mem_gb is None else host_mem_gb * GB),
        "activations": activations,
    }
    # master="none": the offloaded step needs a host copy of the values (bf16), K + 2 there.
    host_k = state["offload_k"]["stage2_offload"]
    report["offload"]["host_k_formula"] = (
        None if host_k == k else k_formula_text(moments, master, on_host=True))
    if layers is not None and hidden is not None:
        report["gpt_params_from_layers_hidden"] = gpt_params(layers, hidden)
    return report
