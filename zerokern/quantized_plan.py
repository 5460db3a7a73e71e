"""Bytes per step and GPU on each kind of link, and communication time per step, of ZeRO with
quantized communication (``ZeroAdamW(gather_dtype="int8", reduce_dtype="int8" | "int4")``):
what ``python -m zerokern estimate --nodes R --gather-dtype int8 --reduce-dtype int4`` prints.
Pure arithmetic (no torch).

The bytes of each collective are :mod:`zerokern.formulas`' (``quantized_all_gather_bytes``,
``quantized_reduce_scatter_bytes``, the two parts of ``quantized_2hop_bytes``: the functions
``comm_stats()`` is tested against, scales and padding included; 16-bit collectives 2 bytes
an element), the seconds :func:`zerokern.comm_model.ring_seconds` of those bytes on the link
each collective crosses. As the engine moves them: every collective cut into calls of
``bucket_numel`` elements (the last one shorter), each call padded to a multiple of its
group's ranks.

Layouts of R nodes x S GPUs (N = R S):

- flat: every collective over all N ranks, a ring through every node: each rank sends
  (N - 1)/N of each counted tensor over an intra-node hop and over an inter-node hop, and the
  ring moves at the slower link. Stage 3: parameter all-gathers in forward and backward
  (``gather_dtype``), the gradient reduce-scatter (``reduce_dtype``); stages 1-2: the
  reduce-scatter and one all-gather of the updated parameters.
- hybrid (state sharded over a node's S GPUs, replicated across nodes): gathers and the
  first reduce hop inside the node; across nodes each rank's reduced slice is all-reduced
  (16-bit) or, quantized, reduce-scattered in ``reduce_dtype`` codes and all-gathered in int8
  codes over the R replicas (the engine's two-hop quantized reduce).
- hpz (stage 3, ``shard_model(mesh=(R, S) mesh, hpz=True)``; ZeRO++'s hpZ): the primary
  partition over all N ranks as flat, so the forward's parameter all-gather (``gather_dtype``)
  and the gradient reduce-scatter (``reduce_dtype``) are flat rings; the backward's all-gather
  reads the in-node secondary copy: over the node's S GPUs, in the parameters' dtype (16-bit,
  whatever ``gather_dtype``: the secondary holds the forward's decoding). The secondary costs
  :func:`zerokern.formulas.hpz_secondary_bytes` per GPU (``secondary_bytes``).

Per-GPU bytes are what one rank sends per step over one link of the kind (ring-exact:
(p - 1)/p of each counted tensor, twice for an all-reduce).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .comm_model import Cluster, Link, ring_seconds
from .formulas import (
    COMM_BYTES,
    hpz_comm_bytes,
    hpz_secondary_bytes,
    quantized_all_gather_bytes,
    quantized_reduce_scatter_bytes,
)

GATHER_DTYPES = (None, "int8")
REDUCE_DTYPES = (None, "int8", "int4")
BITS = {"int8": 8, "int4": 4}
DEFAULT_INTER_GBITS = (25.0, 100.0, 400.0)  # inter-node link speeds of the table, Gb/s per GPU
QUANT_STAGES = (1, 2, 3)  # stage 0 refuses quantized communication (validate.py)
LAYOUTS = ("flat", "hybrid", "hpz")


@dataclass(frozen=True)
class Counted:
    """One collective of a step over all its calls: ``nbytes`` as ``comm_stats()`` counts it
    (all-gather: its output, reduce-scatter: its input, all-reduce: the tensor), over
    ``ranks`` ranks of ``group`` ("flat", "shard" or "replicate"), in ``calls`` calls."""

    kind: str
    what: str
    group: str
    ranks: int
    calls: int
    nbytes: int

    def sent(self) -> Fraction:
        """Bytes each rank sends: (p - 1)/p of the counted bytes, twice for an all-reduce."""
        f = Fraction(self.nbytes * (self.ranks - 1), self.ranks)
        return 2 * f if self.kind == "all_reduce" else f


def check_wire(gather_dtype: str | None, reduce_dtype: str | None) -> None:
    """ValueError naming the argument unless the wire format is one the engine builds."""
    if gather_dtype not in GATHER_DTYPES:
        raise ValueError(f"gather_dtype must be None or 'int8', got {gather_dtype!r}")
    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype must be None, 'int8' or 'int4', got {reduce_dtype!r}")


def _calls(psi: int, bucket_numel: int) -> list[tuple[int, int]]:
    """(elements per call, how many such calls) of a collective on ``psi`` elements."""
    full, last = divmod(psi, bucket_numel)
    return [(n, c) for n, c in ((bucket_numel, full), (last, 1)) if c and n]


def _gather(psi: int, p: int, bits: int | None, bucket: int) -> int:
    # a 16-bit all-gather counts its (padded) output; quantized: formulas' N payloads
    return sum(c * (quantized_all_gather_bytes(-(-n // p), p, bits) if bits
                    else p * -(-n // p) * COMM_BYTES) for n, c in _calls(psi, bucket))


def _reduce(psi: int, p: int, bits: int | None, bucket: int) -> int:
    return sum(c * (quantized_reduce_scatter_bytes(-(-n // p), p, bits) if bits
                    else p * -(-n // p) * COMM_BYTES) for n, c in _calls(psi, bucket))


def _padded(psi: int, p: int, bucket: int) -> int:
    """Elements of every call padded to a multiple of ``p`` ranks (the units' padded space)."""
    return sum(c * -(-n // p) * p for n, c in _calls(psi, bucket))


def _hpz(psi: int, s: int, r: int, gb: int | None, rb: int | None,
         bucket: int) -> list[Counted]:
    """hpZ's collectives (module docstring): the forward gather and the reduce-scatter over
    all N = R S ranks, the backward gather of the secondary shares within the node."""
    n, ncalls = r * s, sum(c for _, c in _calls(psi, bucket))
    # 16-bit bytes per dim, formulas' hpZ count: "world" = forward gather + reduce-scatter
    # (2 bytes each), "shard" = the backward gather in the parameters' 16-bit dtype
    by_dim = hpz_comm_bytes(_padded(psi, n, bucket), s, r, COMM_BYTES)
    half = by_dim["world"] // 2
    fwd = _gather(psi, n, gb, bucket) if gb else half
    red = _reduce(psi, n, rb, bucket) if rb else half
    tag = {None: " (16-bit)", 8: " (int8)", 4: " (int4)"}
    return [Counted("all_gather", "parameters (forward)" + tag[gb], "flat", n, ncalls, fwd),
            Counted("all_gather", "parameters (backward, hpZ secondary, 16-bit)", "shard", s,
                    ncalls, by_dim["shard"]),
            Counted("reduce_scatter", "gradients" + tag[rb], "flat", n, ncalls, red)]


def secondary_bytes(psi: int, nodes: int, gpus_per_node: int, bucket_numel: int) -> int:
    """hpZ's secondary copy per GPU: :func:`zerokern.formulas.hpz_secondary_bytes` of the
    units' space padded to all N ranks (one unit per call of ``bucket_numel``), 16-bit."""
    padded = _padded(psi, nodes * gpus_per_node, bucket_numel)
    return hpz_secondary_bytes(padded, gpus_per_node, nodes, COMM_BYTES)


def _across(psi: int, s: int, r: int, bits: int | None, bucket: int) -> list[Counted]:
    """The cross-node part of the hybrid reduce: each rank's slice of every call."""
    ncalls = sum(c for _, c in _calls(psi, bucket))
    if r == 1:
        return []
    if not bits:
        nbytes = sum(c * -(-n // s) * COMM_BYTES for n, c in _calls(psi, bucket))
        return [Counted("all_reduce", "gradient slice across nodes", "replicate", r, ncalls,
                        nbytes)]
    rs = ag = 0
    for n, c in _calls(psi, bucket):
        chunk = -(-n // s)
        padded = -(-chunk // r) * r  # hops 2-3 split the chunk into R equal parts
        part = padded // r
        rs += c * quantized_reduce_scatter_bytes(part, r, bits)
        ag += c * quantized_all_gather_bytes(part, r, 8)
    return [Counted("reduce_scatter", "gradient slice across nodes (quantized)", "replicate",
                    r, ncalls, rs),
            Counted("all_gather", "reduced slice across nodes (int8)", "replicate", r, ncalls,
                    ag)]


def step_counted(stage: int, psi: int, nodes: int, gpus_per_node: int, hybrid: bool,
                 gather_dtype: str | None = None, reduce_dtype: str | None = None,
                 bucket_numel: int = 1 << 21, hpz: bool = False) -> list[Counted]:
    """The collectives of one step of ``stage`` (1-3) on ``psi`` parameters, with the counted
    bytes of each (:mod:`zerokern.formulas`); ``hpz``: the hpZ layout (stage 3, not with
    ``hybrid``: the two are different layouts of the same mesh)."""
    check_wire(gather_dtype, reduce_dtype)
    if stage not in QUANT_STAGES:
        raise ValueError(f"stage must be 1, 2 or 3 (stage 0 has no quantized communication), "
                         f"got {stage!r}")
    if not isinstance(hpz, bool):
        raise ValueError(f"hpz must be True or False, got {hpz!r}")
    if hpz and (stage != 3 or hybrid):
        raise ValueError(f"hpz is a stage-3 layout of its own (the primary partition over "
                         f"every rank), got hpz=True with stage={stage}, hybrid={hybrid}")
    for name, v in (("psi", psi), ("nodes", nodes), ("gpus_per_node", gpus_per_node),
                    ("bucket_numel", bucket_numel)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    gb, rb = BITS.get(gather_dtype or ""), BITS.get(reduce_dtype or "")
    if hpz:
        return [c for c in _hpz(psi, gpus_per_node, nodes, gb, rb, bucket_numel) if c.ranks > 1]
    group, p = ("shard", gpus_per_node) if hybrid else ("flat", nodes * gpus_per_node)
    ncalls = sum(c for _, c in _calls(psi, bucket_numel))
    def tag(bits: int | None) -> str:
        return f" (int{bits})" if bits else " (16-bit)"

    gathers = (("parameters (forward)", "parameters (backward)") if stage == 3
               else ("updated parameters",))
    out = [Counted("all_gather", w + tag(gb), group, p, ncalls, _gather(psi, p, gb,
                                                                        bucket_numel))
           for w in gathers]
    out.append(Counted("reduce_scatter", "gradients" + tag(rb), group, p, ncalls,
                       _reduce(psi, p, rb, bucket_numel)))
    if hybrid:
        out += _across(psi, gpus_per_node, nodes, rb, bucket_numel)
    return [c for c in out if c.ranks > 1]


def link_bytes(counted: list[Counted], nodes: int, gpus_per_node: int) -> dict[str, Fraction]:
    """Bytes one rank sends per step over each kind of link ("intra", "inter"): shard groups
    inside a node, replicate groups across nodes, a flat ring over both (when it spans them)."""
    out = {"intra": Fraction(0), "inter": Fraction(0)}
    for c in counted:
        links = {"shard": ["intra"], "replicate": ["inter"]}.get(c.group) or (
            ([] if gpus_per_node == 1 else ["intra"]) + ([] if nodes == 1 else ["inter"]))
        for link in links:
            out[link] += c.sent()
    return out


def step_time(counted: list[Counted], cluster: Cluster) -> dict[str, float]:
    """Seconds of the collectives one after another (comm_model's ring model), by the link
    that paces each: shard groups intra, replicate groups and multi-node flat rings inter."""
    by = {"intra": 0.0, "inter": 0.0}
    for c in counted:
        if c.group == "shard" or (c.group == "flat" and cluster.nodes == 1):
            link, key = cluster.intra, "intra"
        else:
            link = cluster.inter if c.group == "replicate" else cluster.ring_link()
            key = "inter"
        by[key] += ring_seconds(c.kind, c.nbytes, c.ranks, link, c.calls)
    return {"total": by["intra"] + by["inter"], **by}


def _num(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def wire_variants(gather_dtype: str | None, reduce_dtype: str | None) -> list[tuple[str | None,
                                                                                   str | None]]:
    """The rows of the comparison: 16-bit, each asked-for option alone, and both together."""
    rows = [(None, None)]
    if gather_dtype:
        rows.append((gather_dtype, None))
    if reduce_dtype:
        rows.append((None, reduce_dtype))
    if gather_dtype and reduce_dtype:
        rows.append((gather_dtype, reduce_dtype))
    return rows


def quantized_plan(psi: float, nodes: int, gpus_per_node: int, hybrid: bool,
                   gather_dtype: str | None, reduce_dtype: str | None, intra: Link,
                   inter_latency_s: float, inter_gbits: tuple[float, ...] = DEFAULT_INTER_GBITS,
                   bucket_numel: int = 1 << 21,
                   stages: tuple[int, ...] = (2, 3), hpz: bool = False) -> dict[str, Any]:
    """The estimate's quantized-communication section: for each layout (flat; hybrid with
    ``hybrid``; hpz, stage 3 only, with ``hpz``), stage and wire format
    (:func:`wire_variants`), the bytes per step and GPU on each kind of link and the
    communication seconds per step with an inter-node link of each speed in ``inter_gbits``
    (Gb/s per GPU and direction; 8 Gb = 1 GB) and ``intra``.

    Args:
        psi: parameters (rounded to an integer).
        nodes: nodes R.
        gpus_per_node: GPUs S per node (the hybrid shard group).
        hybrid: also the hybrid layout (sharded within a node, replicated across).
        gather_dtype: None or "int8": the gather option compared with 16-bit.
        reduce_dtype: None, "int8" or "int4": the reduce option compared with 16-bit.
        intra: the intra-node link (bandwidth GB/s, latency s).
        inter_latency_s: latency of one inter-node ring step, seconds.
        inter_gbits: inter-node speeds, Gb/s per GPU, one time column each.
        bucket_numel: elements per collective call.
        stages: the stages to tabulate (1-3).
        hpz: also the hpZ layout (ZeRO++'s hierarchical partitioning; stage 3 only).

    Returns:
        ``{"params", "nodes", "gpus_per_node", "inter_gbits", "intra_bw_gb_s",
        "bucket_numel", "layouts": {layout: [row, ...]}}``, each row with ``stage``,
        ``gather_dtype``, ``reduce_dtype``, ``intra_bytes`` / ``inter_bytes`` (one GPU's
        sends per step, exact), ``inter_vs_psi`` (those in 16-bit elements over psi),
        ``seconds_by_inter_gbits``, ``secondary_bytes`` (hpZ's in-node copy per GPU; 0 in
        the other layouts) and its ``collectives``.

    Raises:
        ValueError: a wire format the engine does not build, a speed that is not a positive
            number, or a stage, size or count out of range; naming the argument.
    """
    check_wire(gather_dtype, reduce_dtype)
    for g in inter_gbits:
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (
                g > 0 and math.isfinite(g)):
            raise ValueError(f"inter_gbits must be positive numbers, got {g!r}")
    for name, v in (("hybrid", hybrid), ("hpz", hpz)):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be True or False, got {v!r}")
    n = int(round(psi))
    layouts: dict[str, Any] = {}
    for layout in [x for x, on in zip(LAYOUTS, (True, hybrid, hpz)) if on]:
        rows = []
        for stage in [s for s in stages if layout != "hpz" or s == 3]:
            for gd, rd in wire_variants(gather_dtype, reduce_dtype):
                counted = step_counted(stage, n, nodes, gpus_per_node, layout == "hybrid",
                                       gd, rd, bucket_numel, hpz=layout == "hpz")
                lb = link_bytes(counted, nodes, gpus_per_node)
                secs = {f"{g:g}": step_time(counted, Cluster(
                    nodes, gpus_per_node, intra, Link(g / 8, inter_latency_s)))["total"]
                    for g in inter_gbits}
                rows.append({
                    "stage": stage, "gather_dtype": gd, "reduce_dtype": rd,
                    "intra_bytes": _num(lb["intra"]), "inter_bytes": _num(lb["inter"]),
                    "inter_elements_16bit": float(lb["inter"] / COMM_BYTES),
                    "inter_vs_psi": float(lb["inter"] / COMM_BYTES / n),
                    "seconds_by_inter_gbits": secs,
                    "secondary_bytes": secondary_bytes(n, nodes, gpus_per_node, bucket_numel)
                    if layout == "hpz" else 0,
                    "collectives": [{"kind": c.kind, "what": c.what, "group": c.group,
                                     "ranks": c.ranks, "calls": c.calls, "bytes": c.nbytes,
                                     "sent_per_rank_bytes": _num(c.sent())}
                                    for c in counted]})
        layouts[layout] = rows
    return {"params": n, "nodes": nodes, "gpus_per_node": gpus_per_node,
            "inter_gbits": list(inter_gbits), "intra_bw_gb_s": intra.bandwidth_gb_s,
            "bucket_numel": bucket_numel, "layouts": layouts}


def quantized_section(psi: float, cluster: Cluster | None, hybrid: bool, gather_dtype: str | None,
               reduce_dtype: str | None, inter_gbits: Iterable[float] | None,
               bucket_numel: int, hpz: bool = False) -> dict[str, Any] | None:
    """``estimate()``'s quantized-communication section on ``cluster`` (None without
    ``nodes``): :func:`quantized_plan`, or None when none of ``gather_dtype``,
    ``reduce_dtype``, ``inter_gbits``, ``hpz`` is given; ValueError naming the option that is
    wrong or given without ``nodes``."""
    check_wire(gather_dtype, reduce_dtype)
    if not isinstance(hpz, bool):
        raise ValueError(f"hpz must be True or False, got {hpz!r}")
    gbits = None if inter_gbits is None else tuple(inter_gbits)
    given = [n for n, v in (("gather_dtype", gather_dtype), ("reduce_dtype", reduce_dtype),
                            ("inter_gbits", gbits), ("hpz", hpz or None)) if v is not None]
    if not given:
        return None
    if cluster is None:
        raise ValueError(f"{given[0]} needs nodes (the cluster section)")
    if gbits is not None and not gbits:
        raise ValueError("inter_gbits must name at least one link speed")
    return quantized_plan(psi, cluster.nodes, cluster.gpus_per_node, hybrid, gather_dtype,
                          reduce_dtype, cluster.intra, cluster.inter.latency_s,
                          DEFAULT_INTER_GBITS if gbits is None else gbits, bucket_numel,
                          hpz=hpz)
