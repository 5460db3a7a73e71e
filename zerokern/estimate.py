"""Everything ``python -m zerokern estimate`` reports, as one dict of numbers (what ``--json``
prints). Pure arithmetic on top of :mod:`zerokern.formulas`: no printing, no argparse, no torch,
so the CLI, its text report and the tests share one computation.

Bytes are exact; every ``*_gb`` value is bytes / 1e9, the paper's GB.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .comm_model import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_INTER_BW_GB_S,
    DEFAULT_INTER_LATENCY_S,
    DEFAULT_INTRA_BW_GB_S,
    DEFAULT_INTRA_LATENCY_S,
    MODEL_NOTE,
    Cluster,
    Link,
    collective_link,
    collective_seconds,
    link_traffic,
    ring_sent,
    step_collectives,
    step_seconds,
)
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
from .quantized_plan import quantized_section

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


# The cluster options of estimate(): name -> its default when nodes is given.
CLUSTER_DEFAULTS = {
    "gpus_per_node": DEFAULT_GPUS_PER_NODE,
    "intra_bw_gb_s": DEFAULT_INTRA_BW_GB_S,
    "inter_bw_gb_s": DEFAULT_INTER_BW_GB_S,
    "intra_latency_s": DEFAULT_INTRA_LATENCY_S,
    "inter_latency_s": DEFAULT_INTER_LATENCY_S,
    "bucket_numel": DEFAULT_BUCKET_NUMEL,
}


def _check_cluster(nodes: int | None, hybrid: bool, opts: dict[str, Any]) -> Cluster | None:
    """The Cluster of the options (None without ``nodes``); ValueError naming the option that
    is wrong, or that was given without ``nodes``."""
    if nodes is None:
        given = [name for name, v in opts.items() if v is not None] + (
            ["hybrid"] if hybrid else [])
        if given:
            raise ValueError(f"{given[0]} needs nodes (the cluster section)")
        return None
    for name in ("gpus_per_node", "bucket_numel"):
        v = opts[name]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    o = {name: CLUSTER_DEFAULTS[name] if v is None else v for name, v in opts.items()}
    for name in ("intra_bw_gb_s", "inter_bw_gb_s", "intra_latency_s", "inter_latency_s"):
        v, least = o[name], ("a positive number" if "bw" in name else "a number >= 0")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                v <= 0 if "bw" in name else v < 0):
            raise ValueError(f"{name} must be {least}, got {v!r}")
    return Cluster(nodes, o["gpus_per_node"],  # Cluster: ValueError naming nodes
                   Link(o["intra_bw_gb_s"], o["intra_latency_s"]),
                   Link(o["inter_bw_gb_s"], o["inter_latency_s"]))


def _cluster(psi: float, k: float, cluster: Cluster, hybrid: bool, bucket_numel: int,
             capacity: float | None) -> dict[str, Any]:
    """Memory per GPU, traffic per link and communication time per step of every stage on
    ``cluster``, flat and (``hybrid``) hybrid: the estimate's across-nodes section."""
    r, g = cluster.nodes, cluster.gpus_per_node
    layouts: dict[str, Any] = {}
    for name in ("flat", "hybrid") if hybrid else ("flat",):
        shard_n = cluster.world if name == "flat" else g  # ranks the state is divided over
        stages = {}
        for s in STAGES:
            plan = step_collectives(s, psi, cluster, name == "hybrid", COMM_BYTES, COMM_BYTES,
                                    bucket_numel)
            mem = model_state_bytes(s, psi, shard_n, k)
            secs = step_seconds(plan, cluster)
            traffic = link_traffic(plan, cluster)
            stages[f"stage{s}"] = {
                "memory_bytes": mem,
                "memory_gb": mem / GB,
                "fits": None if capacity is None else fits(mem, capacity),
                "traffic": {link: {**t, "gb": t["bytes"] / GB} for link, t in traffic.items()},
                "seconds": secs["total"],
                "seconds_by_link": {"intra": secs["intra"], "inter": secs["inter"]},
                "collectives": [
                    {"kind": c.kind, "what": c.what, "group": c.group, "ranks": c.ranks,
                     "elements": c.elements, "bytes": c.nbytes, "calls": c.calls,
                     "sent_per_rank_elements": ring_sent(c.kind, c.elements, c.ranks),
                     "bandwidth_gb_s": collective_link(c, cluster).bandwidth_gb_s,
                     "latency_s": collective_link(c, cluster).latency_s,
                     "seconds": collective_seconds(c, cluster)}
                    for c in plan],
            }
        layouts[name] = {"shard_ranks": shard_n, "replicate_ranks": 1 if name == "flat" else r,
                         "stages": stages}
    return {
        "nodes": r,
        "gpus_per_node": g,
        "world": cluster.world,
        "hybrid": hybrid,
        "intra": {"bandwidth_gb_s": cluster.intra.bandwidth_gb_s,
                  "latency_s": cluster.intra.latency_s},
        "inter": {"bandwidth_gb_s": cluster.inter.bandwidth_gb_s,
                  "latency_s": cluster.inter.latency_s},
        "bytes_per_element": COMM_BYTES,
        "bucket_numel": bucket_numel,
        "calls_per_collective": max(1, math.ceil(psi / bucket_numel)),
        "model": MODEL_NOTE,
        "layouts": layouts,
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
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    hybrid: bool = False,
    intra_bw_gb_s: float | None = None,
    inter_bw_gb_s: float | None = None,
    intra_latency_s: float | None = None,
    inter_latency_s: float | None = None,
    bucket_numel: int | None = None,
    optimizer: str = "adamw",
    gather_dtype: str | None = None,
    reduce_dtype: str | None = None,
    inter_gbits: Iterable[float] | None = None,
    hpz: bool = False,
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

    ``nodes`` adds the across-nodes section (``report["cluster"]``, else None): ``nodes`` x
    ``gpus_per_node`` ranks (default 8), the flat layout (state divided over all of them, one
    ring over every rank) and with ``hybrid`` the hybrid one (divided over a node's GPUs,
    replicated across nodes): memory per GPU, traffic per link and communication time per
    step of each stage (:mod:`zerokern.comm_model`). Links: ``intra_bw_gb_s`` /
    ``inter_bw_gb_s`` per GPU and direction (default 200 and 25 GB/s), ``intra_latency_s`` /
    ``inter_latency_s`` per ring step (default 2 and 5 us); ``bucket_numel`` elements per
    collective call (default 2**21, ZeroAdamW's) set the latency term. These options without
    ``nodes``: ValueError naming the first one.

    ``optimizer="muon"`` adds ``report["muon"]`` (else None): the owner exchange of
    ``torch.optim.Muon`` on the GPT-like model's hidden matrices (needs ``layers`` and
    ``hidden``; zerokern.estimate_muon).

    ``gather_dtype`` ("int8") / ``reduce_dtype`` ("int8", "int4") / ``inter_gbits`` (inter-node
    link speeds in Gb/s, default 25, 100, 400) add ``report["quantized"]``
    (:func:`zerokern.quantized_plan.quantized_plan`, else None): bytes per step and GPU per
    kind of link and seconds per step at each speed, 16-bit beside each option; they need
    ``nodes`` too. ``hpz`` adds the hpZ layout (stage 3, ``shard_model(hpz=True)``) to that
    section, with its secondary copy's bytes per GPU.
    """
    from .estimate_muon import OPTIMIZERS, muon_section  # imports the owners' plan

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if optimizer == "muon" and (layers is None or hidden is None):
        raise ValueError("optimizer='muon' needs layers and hidden (the matrices' shapes)")
    gpus = [int(n) for n in gpus]
    for n in gpus:
        check_psi_n(psi, n)
    cluster_opts = {"gpus_per_node": gpus_per_node, "intra_bw_gb_s": intra_bw_gb_s,
                    "inter_bw_gb_s": inter_bw_gb_s, "intra_latency_s": intra_latency_s,
                    "inter_latency_s": inter_latency_s, "bucket_numel": bucket_numel}
    cluster = _check_cluster(nodes, hybrid, cluster_opts)
    quant = quantized_section(psi, cluster, hybrid, gather_dtype, reduce_dtype, inter_gbits,
                       DEFAULT_BUCKET_NUMEL if bucket_numel is None else bucket_numel, hpz)
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
        "cluster": None if cluster is None else _cluster(
            psi, k, cluster, hybrid,
            DEFAULT_BUCKET_NUMEL if bucket_numel is None else bucket_numel, capacity),
        "quantized": quant,
    }
    # master="none": the offloaded step needs a host copy of the values (bf16), K + 2 there.
    host_k = state["offload_k"]["stage2_offload"]
    report["offload"]["host_k_formula"] = (
        None if host_k == k else k_formula_text(moments, master, on_host=True))
    if layers is not None and hidden is not None:
        report["gpt_params_from_layers_hidden"] = gpt_params(layers, hidden)
    report["muon"] = (muon_section(layers, hidden, gpus) if optimizer == "muon"
                      and layers is not None and hidden is not None else None)
    return report
