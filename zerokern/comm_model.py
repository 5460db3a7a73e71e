"""Communication time of one ZeRO step on a cluster of nodes: which collectives the step runs,
over which link, the bytes each link carries and the seconds they take. Pure arithmetic (no
torch), shared by ``python -m zerokern estimate``, ``bench/calibrate_comm.py`` and the tests.

Layouts of ``nodes`` (R) x ``gpus_per_node`` (S) ranks:

- flat: every collective runs over all N = R * S ranks. Modelled as one ring through every
  rank, node after node: a ring step ends when its slowest hop does, so with R > 1 the whole
  ring moves at the inter-node link's bandwidth and pays its latency on every step.
- hybrid (FSDP2's HSDP, ZeRO++ hpZ): state sharded over the S ranks of a node, replicated
  across nodes. Gradients are reduce-scattered within the node, then each rank's 1/S slice
  is all-reduced with its R - 1 peers on the other nodes; parameters are all-gathered within
  the node only. Stage 0 (nothing sharded) reduces the same way: a hierarchical all-reduce.

Cost of one collective (Hockney's alpha-beta model of the ring algorithms): over p ranks, on
a tensor of M bytes (all-gather: its output; reduce-scatter: its input; all-reduce: the
tensor), s ring steps, in each of which every rank sends M / p bytes over one link:

    all-gather, reduce-scatter   s = p - 1
    all-reduce                   s = 2 (p - 1)   (a reduce-scatter, then an all-gather)
    seconds = c * s * alpha + s * (M / p) / B    (c calls of M / c bytes each; 0 if p = 1)

B is the link's bandwidth per rank and direction (GB/s = 1e9 B/s), alpha its latency per ring
step. The collectives of a step add up: no overlap with compute or with one another, so the
time is what the step would spend communicating if nothing hid it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

GB = 1e9  # as in zerokern.formulas: 1 GB = 1e9 bytes
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
DEFAULT_BUCKET_NUMEL = 1 << 21  # ZeroAdamW's bucket_numel (zerokern.zero.layout)

# Defaults of the estimate's cluster section: orders of magnitude, not a measurement.
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_INTRA_BW_GB_S = 200.0  # NVLink-class: what an 8-GPU A100/H100 node's rings reach
DEFAULT_INTER_BW_GB_S = 25.0  # 200 Gb/s per GPU (one HDR/NDR200 NIC per GPU); 400 Gb/s: 50
DEFAULT_INTRA_LATENCY_S = 2e-6  # one ring step inside a node
DEFAULT_INTER_LATENCY_S = 5e-6  # one ring step across the network

MODEL_NOTE = (
    "Alpha-beta model of ring collectives: over p ranks a collective on M bytes takes s ring "
    "steps (p-1 for all-gather and reduce-scatter, 2(p-1) for all-reduce), each sending M/p "
    "bytes per rank over one link: time = calls*s*latency + s*(M/p)/bandwidth. Flat: one ring "
    "over all nodes*gpus ranks; with more than one node every ring step waits for the "
    "inter-node hop, so the ring runs at the slowest link. Hybrid: reduce-scatter and "
    "all-gather within a node (intra-node link), the all-reduce of each rank's 1/gpus slice "
    "across nodes (inter-node link). Traffic per link: what one link of that kind carries per "
    "step (what each rank sends over it, ring-exact). Collectives add up: no overlap with "
    "compute or with each other. Rings only: NCCL's tree algorithms cut the latency term to "
    "about log2(p) steps, and a flat ring spread over every NIC of a node (one channel per "
    "rail) moves its inter-node part up to gpus-per-node times faster than this bound."
)


@dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth per rank and direction (GB/s, 1e9 B/s) and latency per
    ring step (s). Bandwidth must be positive, latency finite and >= 0."""

    bandwidth_gb_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bandwidth_gb_s > 0 and math.isfinite(self.bandwidth_gb_s)):
            raise ValueError(f"bandwidth_gb_s must be a positive number, got "
                             f"{self.bandwidth_gb_s!r}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be a number >= 0, got {self.latency_s!r}")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` ranks, an ``intra`` link inside a node and an ``inter``
    link between nodes."""

    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

    @property
    def world(self) -> int:
        """All ranks: nodes x gpus_per_node."""
        return self.nodes * self.gpus_per_node

    def ring_link(self) -> Link:
        """The link a ring over every rank moves at: inside one node the intra-node link,
        across nodes the slower of the two in bandwidth and in latency (a ring step ends when
        its slowest hop does)."""
        if self.nodes == 1:
            return self.intra
        return Link(min(self.intra.bandwidth_gb_s, self.inter.bandwidth_gb_s),
                    max(self.intra.latency_s, self.inter.latency_s))


@dataclass(frozen=True)
class Collective:
    """One collective of a step, summed over its calls (buckets). ``elements``: the full
    tensor (all-gather output, reduce-scatter input, all-reduce tensor) over all calls;
    ``group``: "flat" (all ranks), "shard" (the ranks of a node) or "replicate" (one rank
    per node)."""

    kind: str
    what: str
    elements: float
    bytes_per_element: float
    group: str
    ranks: int
    calls: int

    @property
    def nbytes(self) -> float:
        """Bytes of the full tensor over all calls."""
        return self.elements * self.bytes_per_element


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")


def ring_steps(kind: str, ranks: int) -> int:
    """Ring steps of one collective over ``ranks`` ranks: p-1, or 2(p-1) for an all-reduce."""
    _check_kind(kind)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
    return (2 if kind == "all_reduce" else 1) * (ranks - 1)


def ring_sent(kind: str, size: float, ranks: int) -> float:
    """What each rank sends (elements or bytes, as ``size``) in a ring collective on a
    tensor of ``size``: (p-1)/p of it, twice that for an all-reduce."""
    return ring_steps(kind, ranks) * size / ranks


def ring_seconds(kind: str, nbytes: float, ranks: int, link: Link, calls: int = 1) -> float:
    """Seconds of a ring collective on ``nbytes`` bytes (the full tensor, over all ``calls``)
    over ``ranks`` ranks on ``link``: calls * s * latency + s * (nbytes / p) / bandwidth."""
    if not (nbytes >= 0 and math.isfinite(nbytes)):
        raise ValueError(f"nbytes must be a number >= 0, got {nbytes!r}")
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls must be a positive integer, got {calls!r}")
    s = ring_steps(kind, ranks)
    return calls * s * link.latency_s + s * (nbytes / ranks) / (link.bandwidth_gb_s * GB)


def step_collectives(stage: int, psi: float, cluster: Cluster, hybrid: bool,
                     param_bytes: float = 2, grad_bytes: float = 2,
                     bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> list[Collective]:
    """The collectives of one training step of ``stage`` on ``psi`` parameters, flat or
    hybrid: gradients of ``grad_bytes`` bytes an element (4 for an fp32 reduction),
    parameters of ``param_bytes``. Each collective is cut into ceil(psi / bucket_numel) calls
    (in hybrid, the cross-node all-reduce once per bucket, of its 1/S slice), which sets the
    latency term.

    Stage 0: an all-reduce of the gradients (hybrid: reduce-scatter in the node, all-reduce
    across, all-gather in the node). Stages 1-2: a reduce-scatter of the gradients and an
    all-gather of the updated parameters (hybrid: plus the all-reduce across nodes of the
    slice). Stage 3: two all-gathers of the parameters (forward, backward) and the gradient
    reduce-scatter (hybrid: plus the all-reduce across nodes).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")
    if not (psi > 0 and math.isfinite(psi)):
        raise ValueError(f"psi (parameters) must be a positive number, got {psi!r}")
    for name, v in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes)):
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a positive number, got {v!r}")
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be a positive integer, got {bucket_numel!r}")
    calls = max(1, math.ceil(psi / bucket_numel))
    r, s = cluster.nodes, cluster.gpus_per_node
    if not hybrid:
        def flat(kind: str, what: str, nbytes: float) -> Collective:
            return Collective(kind, what, psi, nbytes, "flat", r * s, calls)

        if stage == 0:
            return [flat("all_reduce", "gradients", grad_bytes)]
        rs = flat("reduce_scatter", "gradients", grad_bytes)
        if stage == 3:
            return [flat("all_gather", "parameters (forward)", param_bytes),
                    flat("all_gather", "parameters (backward)", param_bytes), rs]
        return [rs, flat("all_gather", "updated parameters", param_bytes)]

    reduce = [Collective("reduce_scatter", "gradients", psi, grad_bytes, "shard", s, calls),
              Collective("all_reduce", "gradient slice across nodes", psi / s, grad_bytes,
                         "replicate", r, calls)]
    if stage == 0:
        return [*reduce, Collective("all_gather", "reduced gradients", psi, grad_bytes,
                                    "shard", s, calls)]
    if stage == 3:
        return [Collective("all_gather", "parameters (forward)", psi, param_bytes, "shard", s,
                           calls),
                Collective("all_gather", "parameters (backward)", psi, param_bytes, "shard",
                           s, calls), *reduce]
    return [*reduce, Collective("all_gather", "updated parameters", psi, param_bytes, "shard",
                                s, calls)]


def collective_link(c: Collective, cluster: Cluster) -> Link:
    """The link a collective moves at: shard groups the intra-node link, replicate groups the
    inter-node link, a flat ring the slowest link it crosses (Cluster.ring_link)."""
    if c.group == "shard":
        return cluster.intra
    if c.group == "replicate":
        return cluster.inter
    if c.group == "flat":
        return cluster.ring_link()
    raise ValueError(f"group must be 'flat', 'shard' or 'replicate', got {c.group!r}")


def collective_seconds(c: Collective, cluster: Cluster) -> float:
    """Seconds of one collective of a step (all its calls) on its link."""
    return ring_seconds(c.kind, c.nbytes, c.ranks, collective_link(c, cluster), c.calls)


def link_traffic(collectives: Sequence[Collective],
                 cluster: Cluster) -> dict[str, dict[str, float]]:
    """Elements and bytes one link of each kind ("intra", "inter") carries per step: what
    each rank sends over it, ring-exact ((p-1)/p of each tensor, twice for an all-reduce).

    A flat ring over several nodes crosses both kinds: inside a node from rank to rank, and
    from the last rank of a node to the first of the next, each hop carrying what a rank
    sends. One rank per node is a ring of its own within the node (no intra-node traffic)."""
    out = {link: {"elements": 0.0, "bytes": 0.0} for link in ("intra", "inter")}
    for c in collectives:
        if c.group == "shard":
            links = ["intra"]
        elif c.group == "replicate":
            links = ["inter"]
        else:
            collective_link(c, cluster)  # checks the group
            links = ([] if cluster.gpus_per_node == 1 else ["intra"]) + (
                [] if cluster.nodes == 1 else ["inter"])
        sent = ring_sent(c.kind, c.elements, c.ranks)
        for link in links:
            out[link]["elements"] += sent
            out[link]["bytes"] += sent * c.bytes_per_element
    return out


def step_seconds(collectives: Sequence[Collective], cluster: Cluster) -> dict[str, float]:
    """Seconds of a step's collectives, one after another: in total and by the link each ran
    on ("intra", "inter"; a flat ring over several nodes counts as "inter", the link that
    paces it)."""
    by = {"intra": 0.0, "inter": 0.0}
    for c in collectives:
        on_inter = c.group == "replicate" or (c.group == "flat" and cluster.nodes > 1)
        by["inter" if on_inter else "intra"] += collective_seconds(c, cluster)
    return {"total": by["intra"] + by["inter"], **by}


def _solve2(a11: float, a12: float, a22: float, b1: float, b2: float) -> tuple[float, float]:
    det = a11 * a22 - a12 * a12
    if not det > 1e-12 * a11 * a22:
        raise ValueError("the samples cannot separate latency from bandwidth (give several "
                         "sizes)")
    return (b1 * a22 - b2 * a12) / det, (b2 * a11 - b1 * a12) / det


def _log_cost(rows: list[tuple[float, float, float]], a: float, b: float) -> float:
    return sum(math.log((a * x1 + b * x2) / y) ** 2 for x1, x2, y in rows)


def fit_alpha_beta(samples: Sequence[tuple[str, int, float, float]]) -> Link:
    """The one link (latency alpha, bandwidth B) under which the ring model best explains
    measured collectives: ``samples`` of (kind, ranks, bytes, seconds), seconds = s * alpha
    + s * (bytes / p) / B. Least squares on log(predicted / measured): a 20 us call counts
    as much as a 20 ms one, and a measurement twice too slow (a preempted rank) weighs as
    much as one twice too fast, not more. Gauss-Newton from the linear fit of the relative
    error; alpha >= 0 (else the bandwidth alone is fitted).

    Raises ValueError for fewer than two samples, samples that cannot separate alpha from B,
    or a fit without a positive bandwidth (the measurements then do not grow with size)."""
    rows = []
    for kind, ranks, nbytes, seconds in samples:
        s = ring_steps(kind, ranks)
        if s == 0 or not (seconds > 0 and math.isfinite(seconds)) or not nbytes > 0:
            raise ValueError(f"each sample needs ranks > 1, bytes > 0 and seconds > 0, got "
                             f"{(kind, ranks, nbytes, seconds)!r}")
        rows.append((float(s), s * nbytes / ranks, float(seconds)))
    if len(rows) < 2:
        raise ValueError(f"need at least two samples to fit alpha and beta, got {len(rows)}")
    # Start: minimize sum ((a*x1 + b*x2 - y) / y)^2, linear in (a, b = 1 / (B * GB)).
    w = [(x1 / y, x2 / y) for x1, x2, y in rows]
    a, b = _solve2(sum(u * u for u, _ in w), sum(u * v for u, v in w), sum(v * v for _, v in w),
                   sum(u for u, _ in w), sum(v for _, v in w))
    if not b > 0:
        raise ValueError(f"fitted time per byte is {b!r}: no positive bandwidth")
    a = max(a, 0.0)
    for _ in range(200):  # Gauss-Newton on r = log(a*x1 + b*x2) - log(y), halving steps
        j = [(x1 / (a * x1 + b * x2), x2 / (a * x1 + b * x2),
              math.log((a * x1 + b * x2) / y)) for x1, x2, y in rows]
        da, db = _solve2(sum(u * u for u, _, _ in j), sum(u * v for u, v, _ in j),
                         sum(v * v for _, v, _ in j), -sum(u * r for u, _, r in j),
                         -sum(v * r for _, v, r in j))
        cost, t = _log_cost(rows, a, b), 1.0
        while t > 1e-9 and not (b + t * db > 0
                                and all((a + t * da) * x1 + (b + t * db) * x2 > 0
                                        for x1, x2, _ in rows)
                                and _log_cost(rows, a + t * da, b + t * db) <= cost):
            t /= 2
        if t <= 1e-9:
            break
        a, b = a + t * da, b + t * db
        if abs(t * da) <= 1e-12 * abs(a) + 1e-18 and abs(t * db) <= 1e-12 * b:
            break
    if a < 0:  # a latency cannot be negative: the best fit with alpha = 0, in closed form
        a, b = 0.0, math.exp(sum(math.log(y / x2) for _, x2, y in rows) / len(rows))
    return Link(1.0 / (b * GB), a)
