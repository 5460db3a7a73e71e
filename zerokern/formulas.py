"""The ZeRO paper's formulas, in one place (pure arithmetic, no torch): what a rank holds
and what a step sends. Used by ``python -m zerokern estimate``, the demo's report and tests.

Notation (paper §3.1, §5): Psi parameters, N data-parallel ranks (the paper's N_d), K bytes of
optimizer state per parameter, p-byte parameters and gradients. Model-state bytes per rank
(§5.4), replicated bytes per parameter plus bytes per parameter divided over N:

    stage 0  DP         (2p + K) Psi
    stage 1  P_os       2p Psi + K Psi / N
    stage 2  P_os+g     p Psi + (p + K) Psi / N
    stage 3  P_os+g+p   (2p + K) Psi / N

For the paper's mixed precision (p = 2, K = 12: fp32 master weight, momentum and variance)
these are 16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N and 16 Psi/N. fp32 parameters are their
own master, so K = 8 there. Communication per step (§7): 2 Psi elements for stages 0-2
(all-reduce = reduce-scatter + all-gather), 3 Psi for stage 3 (parameters all-gathered in
forward and in backward, gradients reduce-scattered); nothing with one rank. Model size and
activations (§3.2, §6.1, §10.1): 12 L H^2 parameters of a GPT-like model, 12 h b s L
activation values without checkpointing, h b s L with one checkpoint per layer.

GB means 1e9 bytes, as in the paper (7.5B parameters on 64 GPUs: 120, 31.4, 16.6, 1.88 GB).

Compressed optimizer state (``ZeroAdamW(moments=, master=)``, docs/compressed-state.md)
changes only K, the bytes of optimizer state per parameter (:func:`optimizer_state_parts`):
the master (4 bytes fp32, or none), the two moments (4 fp32, 2 bf16 or 1 int8 code each) and,
for int8, one fp32 absmax per 256-element block of each moment (4/256 byte each). For the
parameters large enough to compress (4,096 elements or more):

    moments  master   K                              K with offload (host)
    fp32     fp32     4 + 4 + 4           = 12       12
    bf16     fp32     4 + 2 + 2           = 8        8
    int8     fp32     4 + 1 + 1 + 8/256   = 6.03125  6.03125
    fp32     none     0 + 4 + 4           = 8        10 (a bf16 copy of the shard for the step)
    bf16     none     0 + 2 + 2           = 4        6
    int8     none     0 + 1 + 1 + 8/256   = 2.03125  4.03125

These are what ``memory_stats()`` measures (tests/test_compressed_memory.py checks it); smaller
parameters keep fp32 moments (8 more bytes an element), negligible in a large model.

Hybrid sharding (``ZeroAdamW(mesh=)``, a 2-D mesh of R replicas x S ranks per shard group,
docs/hybrid.md): memory is the formula above with N = S. Communication per step and rank,
split by mesh dim (:func:`hybrid_comm_elements`, paper count; :func:`hybrid_wire_elements`,
what each link carries under ring collectives):

    stages 0-2   shard 2 Psi  (wire 2 Psi (S-1)/S)   replicate 2 Psi/S  (wire 2 Psi (R-1)/(R S))
    stage 3      shard 3 Psi  (wire 3 Psi (S-1)/S)   replicate 2 Psi/S  (wire 2 Psi (R-1)/(R S))

Gradients reduced in fp32 (``reduce_dtype=torch.float32``, g = 4 bytes for p = 2-byte
parameters) change the gradient terms of the memory (:func:`coefficients`) and the bytes of
the gradient collectives (:func:`hybrid_comm_bytes`), never the element counts.

ZeRO-Offload (Ren et al. 2021; ``ZeroAdamW(..., offload="cpu")``) moves a rank's optimizer
state (K Psi / N) and its gradient shard (p Psi / N) to host memory; ZeRO-Infinity's parameter
offload (``shard_model(..., offload_params=True)``) moves stage 3's parameter shard there too.
Device and host bytes per rank, model states only (constant buffers aside: buckets, staging):

    stage 1 + offload           device 2p Psi        host (p + K) Psi / N
    stage 2 + offload           device p Psi         host (p + K) Psi / N
    stage 3 + offload           device p Psi / N     host (p + K) Psi / N
    stage 3 + offload + params  device 0             host (2p + K) Psi / N

Quantized communication (ZeRO++ qwZ/qgZ, ``zerokern.comm.quantized``): a piece of n elements
travels as one fp32 scale per block of B elements and an int8 (b = 8) or int4 (b = 4) code per
element, the codes padded to whole 4-byte words: ``4 ceil(n/B) + 4 ceil(ceil(n b/8) / 4)``
bytes (:func:`quantized_payload_bytes`; B = 256 for int8 and 32 for int4 by default,
``QUANT_BLOCKS``: 1.0156 and 0.625 bytes an element, against 2 for bf16). A quantized
all-gather or reduce-scatter over N ranks counts N such payloads
(:func:`quantized_all_gather_bytes`, :func:`quantized_reduce_scatter_bytes`), the two-hop
reduce of a 2-D mesh one per hop and dim (:func:`quantized_2hop_bytes`).
"""

from __future__ import annotations

import math
from fractions import Fraction

GB = 1e9  # the paper's unit: 1 GB = 1e9 bytes
PARAM_BYTES = 2  # fp16/bf16 working weights
GRAD_BYTES = 2  # fp16/bf16 gradients
DEFAULT_K = 12  # fp32 master weights + Adam momentum + variance: 4 + 4 + 4
COMM_BYTES = 2  # bytes per communicated element (fp16/bf16)
ACT_BYTES = 2  # bytes per stored activation value (fp16/bf16)

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
STAGE_FORMULAS = {
    0: "(2+2+K)*Psi",
    1: "4*Psi + K*Psi/N",
    2: "2*Psi + (2+K)*Psi/N",
    3: "(2+2+K)*Psi/N",
}
# Per-step communication in units of Psi elements (paper §7.1-7.2.2).
COMM_FORMULAS = {0: "2*Psi", 1: "2*Psi", 2: "2*Psi", 3: "3*Psi"}


# --------------------------------------------------------------------------------------------
# Model-state memory (paper §5.1-5.4, Table 1)
# --------------------------------------------------------------------------------------------


def check_psi_n(psi: float, n: int) -> None:
    """Raise ValueError unless ``psi`` (parameters) is positive and ``n`` (GPUs) a positive
    integer."""
    if not psi > 0:
        raise ValueError(f"number of parameters must be positive, got {psi!r}")
    if int(n) != n or n < 1:
        raise ValueError(f"number of GPUs must be a positive integer, got {n!r}")


def coefficients(stage: int, param_bytes: int = PARAM_BYTES,
                 k: float | None = None, reduce_bytes: int | None = None) -> tuple[float, float]:
    """(bytes per parameter held by every rank, bytes per parameter divided over N) of a
    stage, with ``param_bytes``-byte parameters and gradients and K bytes of optimizer state
    per parameter (default: ``optimizer_bytes_per_param(param_bytes)``).

    ``reduce_bytes`` (``ZeroAdamW(reduce_dtype=torch.float32)``: 4): gradients reduced in a
    wider dtype g than the parameters' p. Stage 0 keeps autograd's p-byte gradient and a
    g-byte averaged one (2p + g + K); stage 1 a g-byte gradient shard beside its p-byte
    full gradient (2p + (g + K)/N); stages 2-3 hold the gradient shard in g bytes
    (p + (g + K)/N, (p + g + K)/N).

    >>> coefficients(2, 2, 12, reduce_bytes=4)
    (2, 16)
    """
    p = param_bytes
    k = optimizer_bytes_per_param(p) if k is None else k
    g = p if reduce_bytes is None else reduce_bytes
    x = g if g != p else 0  # a second gradient buffer, in the reduce dtype
    return {0: (2 * p + x + k, 0), 1: (2 * p, x + k), 2: (p, g + k), 3: (0, p + g + k)}[stage]


def _mem(stage: int, psi: float, n: int, k: float) -> float:
    check_psi_n(psi, n)
    rep, shard = coefficients(stage, PARAM_BYTES, k)
    return rep * psi + shard * psi / n


def mem_dp(psi: float, n: int = 1, k: float = DEFAULT_K) -> float:
    """Stage 0, plain data parallelism: every GPU holds (2 + 2 + K) Psi bytes, whatever N is."""
    return _mem(0, psi, n, k)


def mem_os(psi: float, n: int, k: float = DEFAULT_K) -> float:
    """Stage 1, P_os (§5.1): 4 Psi + K Psi / N bytes per GPU."""
    return _mem(1, psi, n, k)


def mem_os_g(psi: float, n: int, k: float = DEFAULT_K) -> float:
    """Stage 2, P_os+g (§5.2): 2 Psi + (2 + K) Psi / N bytes per GPU."""
    return _mem(2, psi, n, k)


def mem_os_g_p(psi: float, n: int, k: float = DEFAULT_K) -> float:
    """Stage 3, P_os+g+p (§5.3): (2 + 2 + K) Psi / N bytes per GPU."""
    return _mem(3, psi, n, k)


_MEM_FUNCS = {0: mem_dp, 1: mem_os, 2: mem_os_g, 3: mem_os_g_p}


def model_state_bytes(stage: int, psi: float, n: int, k: float = DEFAULT_K) -> float:
    """Per-GPU model-state bytes (parameters + gradients + optimizer state) for a ZeRO stage."""
    if stage not in _MEM_FUNCS:
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")
    return _MEM_FUNCS[stage](psi, n, k)


def fits(nbytes: float, capacity: float) -> bool:
    """Whether ``nbytes`` fit in ``capacity`` bytes (exact ties count as fitting)."""
    # a hair of slack so that exact ties (e.g. 128B params on 64 GPUs = 32 GB) count as fitting
    return nbytes <= capacity * (1 + 1e-12)


def min_gpus_to_fit(stage: int, psi: float, capacity_bytes: float, k: float = DEFAULT_K):
    """Smallest N whose per-GPU model states fit in ``capacity_bytes``; None if no N does.

    Stages 0-2 keep a replicated part (16, 4 and 2 bytes per parameter for K = 12 as N grows)
    that no number of GPUs removes; stage 3 always fits for large enough N.
    """
    if capacity_bytes <= 0:
        return None
    if stage == 0:
        return 1 if fits(mem_dp(psi, 1, k), capacity_bytes) else None
    rep, shard = coefficients(stage, PARAM_BYTES, k)
    floor, sharded = rep * psi, shard * psi
    if sharded == 0:  # K = 0 in stage 1: nothing is partitioned
        return 1 if fits(floor, capacity_bytes) else None
    room = capacity_bytes - floor
    if room <= 0:
        return None
    n = max(1, math.ceil(sharded / room))
    # guard against float rounding around exact ties
    while n > 1 and fits(model_state_bytes(stage, psi, n - 1, k), capacity_bytes):
        n -= 1
    while not fits(model_state_bytes(stage, psi, n, k), capacity_bytes):
        n += 1
    return n


# --------------------------------------------------------------------------------------------
# Communication (paper §7)
# --------------------------------------------------------------------------------------------


def comm_elements(psi: float, stage: int) -> float:
    """Per-step communication volume in elements, as counted in the paper's §7.

    Plain DP all-reduce = reduce-scatter + all-gather = 2 Psi (§7.1). Stages 1 and 2 replace it
    by a gradient reduce-scatter and an all-gather of the updated parameters: also 2 Psi
    (§7.2.1). Stage 3 all-gathers the parameters in forward and again in backward, plus the
    gradient reduce-scatter: 3 Psi, 1.5x the baseline (§7.2.2).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")
    return (3 if stage == 3 else 2) * psi


def comm_bytes(psi: float, stage: int, bytes_per_element: float = COMM_BYTES) -> float:
    """Per-step communication volume in bytes (2 bytes per fp16/bf16 element by default)."""
    return comm_elements(psi, stage) * bytes_per_element


def comm_seconds(
    psi: float, stage: int, bandwidth_gb_s: float, bytes_per_element: float = COMM_BYTES
) -> float:
    """Time to move ``comm_bytes`` over a per-GPU link of ``bandwidth_gb_s`` GB/s (1e9 B/s)."""
    if not bandwidth_gb_s > 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_gb_s!r}")
    return comm_bytes(psi, stage, bytes_per_element) / (bandwidth_gb_s * GB)


# --------------------------------------------------------------------------------------------
# Model size and activations (paper §3.2, §6.1, §10.1)
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


# ------------------------------------------------------------------------------------------
# Exact per-rank figures for any parameter width (the demo and the tests compare measured
# bytes with these)
# ------------------------------------------------------------------------------------------


def _check(stage: int, psi: int, world: int, param_bytes: int) -> None:
    if stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if psi < 0 or world < 1:
        raise ValueError(f"need psi >= 0 and world >= 1, got psi={psi}, world={world}")
    if param_bytes not in (2, 4):
        raise ValueError(f"param_bytes must be 2 (fp16/bf16) or 4 (fp32), got {param_bytes!r}")


MOMENT_FORMATS = ("fp32", "bf16", "int8")
"""``ZeroAdamW(moments=)``: what each Adam moment is stored as."""
MASTER_MODES = ("fp32", "none")
"""``ZeroAdamW(master=)``: an fp32 master copy of the parameters, or none."""
MOMENT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
QUANT_BLOCK = 256  # elements per int8 block (zerokern.quant.maps.BLOCK)
ABSMAX_BYTES = 4  # one fp32 absmax per block and moment
MIN_COMPRESSED_NUMEL = 4096  # smaller parameters keep fp32 moments (zerokern.quant.adamw)


def _check_format(moments: str, master: str, param_bytes: int) -> None:
    if not isinstance(moments, str) or moments not in MOMENT_FORMATS:
        raise ValueError(f"moments must be one of {', '.join(map(repr, MOMENT_FORMATS))}, "
                         f"got {moments!r}")
    if not isinstance(master, str) or master not in MASTER_MODES:
        raise ValueError(f"master must be one of {', '.join(map(repr, MASTER_MODES))}, "
                         f"got {master!r}")
    if param_bytes not in (2, 4):
        raise ValueError(f"param_bytes must be 2 (fp16/bf16) or 4 (fp32), got {param_bytes!r}")
    if master == "none" and param_bytes != 2:
        raise ValueError("master='none' needs 16-bit (bf16) parameters, got param_bytes="
                         f"{param_bytes}")


def optimizer_state_parts(moments: str = "fp32", master: str = "fp32",
                          param_bytes: int = PARAM_BYTES, *, on_host: bool = False,
                          params_on_host: bool = False) -> dict[str, Fraction]:
    """K's parts: bytes per parameter of each optimizer-state kind (memory_stats() names) for
    a parameter of at least 4,096 elements, as exact fractions.

    ``on_host``: the state is offloaded (``offload="cpu"``): the step runs on a host copy of
    the values, an fp32 master for fp32 parameters too, and a bf16 copy of the parameters
    with ``master="none"``; ``params_on_host``: stage 3's parameter shard lives in host memory
    already (``offload_params=True``), so no copy is kept beside it for ``master="none"`` or
    fp32 parameters.

    >>> parts = optimizer_state_parts("int8", "fp32")
    >>> str(parts["exp_avg_absmax"]), str(sum(parts.values()))
    ('1/64', '193/32')
    """
    _check_format(moments, master, param_bytes)
    copy = on_host and not params_on_host  # the step's values are a host copy
    if master == "none":
        m = 2 if copy else 0  # a bf16 copy of the parameters, never fp32
    else:
        m = 4 if param_bytes < 4 or copy else 0  # fp32 parameters are their own master
    e = MOMENT_BYTES[moments]
    parts = {"master": Fraction(m), "exp_avg": Fraction(e), "exp_avg_sq": Fraction(e)}
    if moments == "int8":
        parts["exp_avg_absmax"] = parts["exp_avg_sq_absmax"] = Fraction(ABSMAX_BYTES,
                                                                        QUANT_BLOCK)
    return parts


def optimizer_bytes_per_param(param_bytes: int, moments: str = "fp32", master: str = "fp32",
                              *, on_host: bool = False,
                              params_on_host: bool = False) -> int | float:
    """K: bytes of optimizer state per parameter. The paper's 12 (fp32 master + two fp32
    moments) for 16-bit parameters, 8 for fp32 ones (their own master); a compressed format's
    K (:func:`optimizer_state_parts`): 8 for bf16 moments, 6.03125 for int8 ones (fp32 master),
    4 and 2.03125 with ``master="none"``. An int when K is whole, else the exact float.

    >>> optimizer_bytes_per_param(2, "int8", "fp32")  # 4 + 1 + 1 + 2 x 4/256
    6.03125
    """
    return _exact(sum(optimizer_state_parts(moments, master, param_bytes, on_host=on_host,
                                            params_on_host=params_on_host).values(),
                      Fraction(0)))


def k_formula_text(moments: str = "fp32", master: str = "fp32", param_bytes: int = PARAM_BYTES,
                   *, on_host: bool = False, params_on_host: bool = False) -> str:
    """K spelled out by part, e.g. '4 master + 1 + 1 int8 moments + 2 x 4/256 absmax =
    6.03125'."""
    parts = optimizer_state_parts(moments, master, param_bytes, on_host=on_host,
                                  params_on_host=params_on_host)
    mname = "bf16 copy" if master == "none" else "fp32 master"
    terms = [f"{_exact(parts['master'])} {mname}"] if parts["master"] else []
    e = MOMENT_BYTES[moments]
    terms.append(f"{e} + {e} {moments} moments")
    if "exp_avg_absmax" in parts:
        terms.append(f"2 x {ABSMAX_BYTES}/{QUANT_BLOCK} fp32 absmax")
    total = optimizer_bytes_per_param(param_bytes, moments, master, on_host=on_host,
                                      params_on_host=params_on_host)
    return " + ".join(terms) + f" = {total:g}"


def _exact(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def _format_k(param_bytes: int, moments: str, master: str) -> Fraction:
    return sum(optimizer_state_parts(moments, master, param_bytes).values(), Fraction(0))


def expected_model_state_bytes(stage: int, psi: int, world: int, param_bytes: int,
                               moments: str = "fp32", master: str = "fp32", *,
                               reduce_bytes: int | None = None) -> int | float:
    """Paper §5.4 model-state bytes per rank (an int whenever psi is divisible by world, and
    by 64 for int8 moments), with the K of the state format (``moments``, ``master``) and
    gradients reduced in ``reduce_bytes``-byte elements (:func:`coefficients`). On a 2-D
    mesh ``world`` is the shard group's size S: replicas hold the same bytes.

    >>> [expected_model_state_bytes(s, 8, 4, 2) for s in range(4)]  # the paper's tiny example
    [128, 56, 44, 32]
    >>> expected_model_state_bytes(3, 256, 1, 2, "int8", "none")  # (2 + 2 + 2.03125) * 256
    1544
    >>> expected_model_state_bytes(2, 8, 4, 2, reduce_bytes=4)  # 2*8 + (4 + 12)*8/4
    48
    """
    _check(stage, psi, world, param_bytes)
    if reduce_bytes is not None and reduce_bytes not in (2, 4):
        raise ValueError(f"reduce_bytes must be 2 or 4, got {reduce_bytes!r}")
    rep, shard = coefficients(stage, param_bytes, _format_k(param_bytes, moments, master),
                              reduce_bytes)
    return _exact(rep * Fraction(psi) + shard * Fraction(psi, world))


def state_formula_text(stage: int, param_bytes: int, moments: str = "fp32",
                       master: str = "fp32") -> str:
    """The formula as text, e.g. '4Ψ+12Ψ/N' (int8 moments, fp32 master: '4Ψ+6.03125Ψ/N')."""
    rep, shard = coefficients(stage, param_bytes, _format_k(param_bytes, moments, master))
    parts = ([f"{_exact(Fraction(rep))}Ψ"] if rep else []) + (
        [f"{_exact(Fraction(shard))}Ψ/N"] if shard else [])
    return "+".join(parts)


def zerokern_extra_bytes(
    stage: int, psi: int, world: int, param_bytes: int
) -> dict[str, int | float]:
    """Bytes per rank that zerokern holds beyond the paper's formula, by reason: none.

    Stage 1 reduce-scatters in place into the full-size gradient (as the paper's P_os keeps
    it), and fp32 params keep no master copy (every stage updates this rank's parameters in
    place). The demo accepts measured == formula or measured == formula + these, and says
    which, so a future buffer beyond the paper has to be named here to pass.
    """
    _check(stage, psi, world, param_bytes)
    return {}


def expected_comm_elements(stage: int, psi: int, world: int) -> int:
    """Paper §7 elements per step: 2 Psi (stages 0-2) or 3 Psi (stage 3); 0 for one rank."""
    _check(stage, psi, world, 2)
    if world == 1:
        return 0
    return (3 if stage == 3 else 2) * psi


# ------------------------------------------------------------------------------------------
# Hybrid sharding on a 2-D mesh: R replicas x S ranks per shard group (ZeroAdamW(mesh=))
# ------------------------------------------------------------------------------------------

MESH_DIMS = ("shard", "replicate")
"""The keys of ``comm_stats()["per_dim"]`` and of the hybrid formulas' results."""


def _check_mesh(stage: int, psi: int, shard: int, replicate: int) -> None:
    _check(stage, psi, shard, 2)
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
        raise ValueError(f"replicate must be an int >= 1, got {replicate!r}")


def hybrid_comm_elements(stage: int, psi: int, shard: int,
                         replicate: int = 1) -> dict[str, int | float]:
    """Elements per step and rank on each mesh dim, counted as the paper counts (§7: a
    reduce-scatter or all-gather moves its full tensor's elements once, an all-reduce
    twice), for ``psi`` elements (as laid out, padding included) over S = ``shard`` ranks
    per shard group and R = ``replicate`` replicas.

    Shard dim: the gradient reduce-scatter and the all-gather (stages 0-2: 2 Psi; stage 0
    gathers the averaged gradient, stages 1-2 the new parameters), stage 3 gathering twice
    (3 Psi); 0 when S = 1. Replicate dim: the all-reduce of this rank's reduced slice, 2 Psi
    / S; 0 when R = 1. A flat group is R = 1 (stage 0's all-reduce counts as its 2 Psi).

    >>> hybrid_comm_elements(2, 64, 2, 2)
    {'shard': 128, 'replicate': 64}
    """
    _check_mesh(stage, psi, shard, replicate)
    rs = 0 if shard == 1 else (3 if stage == 3 else 2) * psi
    rep = 0 if replicate == 1 else _exact(Fraction(2 * psi, shard))
    return {"shard": rs, "replicate": rep}


def hybrid_wire_elements(stage: int, psi: int, shard: int,
                         replicate: int = 1) -> dict[str, int | float]:
    """Elements each rank sends per step on each mesh dim under bandwidth-optimal
    collectives (ring reduce-scatter and all-gather send (n-1)/n of the full tensor, an
    all-reduce twice that): what each link carries. Stages 0-2 move 2 Psi (S-1)/S inside the
    shard group (stage 3: 3 Psi (S-1)/S) and 2 Psi (R-1)/(R S) across it.

    >>> hybrid_wire_elements(2, 64, 2, 2)
    {'shard': 64, 'replicate': 32}
    """
    _check_mesh(stage, psi, shard, replicate)
    c = 3 if stage == 3 else 2
    return {"shard": _exact(Fraction(c * psi * (shard - 1), shard)),
            "replicate": _exact(Fraction(2 * psi * (replicate - 1), replicate * shard))}


def hybrid_comm_bytes(stage: int, psi: int, shard: int, replicate: int = 1,
                      param_bytes: int = PARAM_BYTES,
                      reduce_bytes: int | None = None) -> dict[str, int | float]:
    """Bytes of :func:`hybrid_comm_elements` per dim: gradients move in ``reduce_bytes``
    (default ``param_bytes``), gathered parameters in ``param_bytes`` (stage 0 gathers the
    averaged gradient, in ``reduce_bytes``).

    >>> hybrid_comm_bytes(2, 64, 2, 2, 2, reduce_bytes=4)  # RS 64x4 + AG 64x2; AR 2x32x4
    {'shard': 384, 'replicate': 256}
    """
    _check_mesh(stage, psi, shard, replicate)
    p = param_bytes
    g = p if reduce_bytes is None else reduce_bytes
    gather = {0: psi * g, 1: psi * p, 2: psi * p, 3: 2 * psi * p}[stage]
    rs = 0 if shard == 1 else psi * g + gather
    rep = 0 if replicate == 1 else _exact(Fraction(2 * psi * g, shard))
    return {"shard": rs, "replicate": rep}


# ------------------------------------------------------------------------------------------
# ZeRO-Offload: device and host bytes per rank
# ------------------------------------------------------------------------------------------

OFFLOAD_VARIANTS = ("stage1_offload", "stage2_offload", "stage3_offload", "stage3_offload_params")
OFFLOAD_NAMES = {"stage1_offload": "P_os +off", "stage2_offload": "P_os+g +off",
                 "stage3_offload": "P_os+g+p +off", "stage3_offload_params": "+off params"}
OFFLOAD_FORMULAS = {
    "stage1_offload": ("4*Psi", "(2+K)*Psi/N"),
    "stage2_offload": ("2*Psi", "(2+K)*Psi/N"),
    "stage3_offload": ("2*Psi/N", "(2+K)*Psi/N"),
    "stage3_offload_params": ("0", "(2+2+K)*Psi/N"),
}


def offload_k(variant: str, moments: str = "fp32", master: str = "fp32",
              param_bytes: int = PARAM_BYTES) -> int | float:
    """K on the host of an offload variant: the format's K, plus a bf16 copy of the shard
    (2 bytes) with ``master="none"`` unless the parameters live in host memory already
    (``stage3_offload_params``)."""
    if variant not in OFFLOAD_VARIANTS:
        raise ValueError(f"offload variant must be one of {OFFLOAD_VARIANTS}, got {variant!r}")
    return optimizer_bytes_per_param(param_bytes, moments, master, on_host=True,
                                     params_on_host=variant == "stage3_offload_params")


def offload_coefficients(variant: str, param_bytes: int = PARAM_BYTES,
                         k: float | None = None) -> tuple[tuple[float, float], tuple[float, float]]:
    """((device bytes per parameter replicated, divided over N), (host: the same)) of an
    offload variant (``OFFLOAD_VARIANTS``)."""
    p = param_bytes
    k = optimizer_bytes_per_param(p) if k is None else k
    table = {
        "stage1_offload": ((2 * p, 0), (0, p + k)),
        "stage2_offload": ((p, 0), (0, p + k)),
        "stage3_offload": ((0, p), (0, p + k)),
        "stage3_offload_params": ((0, 0), (0, 2 * p + k)),
    }
    if variant not in table:
        raise ValueError(f"offload variant must be one of {OFFLOAD_VARIANTS}, got {variant!r}")
    return table[variant]


def offload_bytes(variant: str, psi: float, n: int, k: float = DEFAULT_K,
                  param_bytes: int = PARAM_BYTES) -> tuple[float, float]:
    """(device, host) model-state bytes per rank with offload (constant buffers aside).

    >>> offload_bytes("stage2_offload", 8, 4)  # 2*8 on the device, 14*8/4 on the host
    (16.0, 28.0)
    """
    check_psi_n(psi, n)
    (dr, ds), (hr, hs) = offload_coefficients(variant, param_bytes, k)
    return dr * psi + ds * psi / n, hr * psi + hs * psi / n


def offload_min_gpus_to_fit(variant: str, psi: float, device_bytes: float,
                            host_bytes: float | None, k: float = DEFAULT_K) -> int | None:
    """Smallest N whose per-rank device bytes fit ``device_bytes`` and host bytes fit
    ``host_bytes`` (None: the host is not limited); None if no N does."""
    if device_bytes < 0:
        return None
    (dr, ds), (hr, hs) = offload_coefficients(variant, PARAM_BYTES, k)

    def need(rep: float, shard: float, cap: float) -> int | None:
        if shard == 0:  # nothing divided over N: fits on one rank or never
            return 1 if fits(rep * psi, cap) else None
        room = cap - rep * psi
        if room <= 0:
            return None
        n = max(1, math.ceil(shard * psi / room))
        while n > 1 and fits(rep * psi + shard * psi / (n - 1), cap):
            n -= 1
        while not fits(rep * psi + shard * psi / n, cap):
            n += 1
        return n

    nd = need(dr, ds, device_bytes)
    nh = 1 if host_bytes is None else need(hr, hs, host_bytes)
    return None if nd is None or nh is None else max(nd, nh)


# ------------------------------------------------------------------------------------------
# Quantized communication (ZeRO++ qwZ / qgZ): bytes of the quantized collectives
# ------------------------------------------------------------------------------------------

QUANT_BLOCK = 256  # elements per quantization block by default (zerokern.quant.comm_codec)
# The quantized collectives' block by code width (zerokern.quant.comm_codec.WIRE_BLOCK): int4's
# finer block keeps small gradients from rounding to zero next to a large one.
QUANT_BLOCKS = {8: QUANT_BLOCK, 4: 32}


def _block(bits: int, block: int | None) -> int:
    return QUANT_BLOCKS.get(bits, QUANT_BLOCK) if block is None else block


def _check_quant(numel: int, world: int, bits: int, block: int) -> None:
    for name, v, lo in (("numel", numel, 0), ("world", world, 1), ("block", block, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if bits not in (8, 4) or isinstance(bits, bool):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")


def quantized_payload_bytes(numel: int, bits: int = 8, block: int | None = None) -> int:
    """Bytes of one quantized piece of ``numel`` elements: a 4-byte fp32 scale per block of
    ``block`` elements (the last one partial; None: ``QUANT_BLOCKS[bits]``, 256 for 8 bits
    and 32 for 4) and ``bits`` per element of codes, rounded up to whole bytes and then to
    whole 4-byte words.

    >>> quantized_payload_bytes(1000, 8), quantized_payload_bytes(1001, 4, 256)
    (1016, 520)
    >>> quantized_payload_bytes(1001, 4)
    632
    """
    block = _block(bits, block)
    _check_quant(numel, 1, bits, block)
    code_bytes = -(-numel * bits // 8)
    return 4 * -(-numel // block) + 4 * -(-code_bytes // 4)


def quantized_all_gather_bytes(shard_numel: int, world: int, bits: int = 8,
                               block: int | None = None) -> int:
    """Bytes a quantized all-gather of ``shard_numel`` elements per rank counts over
    ``world`` ranks: the N gathered payloads (what ``CommStats`` records, as an all-gather
    counts its output); each rank sends (N - 1)/N of them on a ring. 0 with one rank.

    >>> quantized_all_gather_bytes(1000, 4)
    4064
    """
    block = _block(bits, block)
    _check_quant(shard_numel, world, bits, block)
    return 0 if world == 1 else world * quantized_payload_bytes(shard_numel, bits, block)


def quantized_reduce_scatter_bytes(chunk_numel: int, world: int, bits: int = 8,
                                   block: int | None = None) -> int:
    """Bytes a quantized reduce-scatter to ``chunk_numel`` elements per rank counts over
    ``world`` ranks: the payloads of the input's N chunks (as a reduce-scatter counts its
    input); each rank sends N - 1 of them. 0 with one rank.

    >>> quantized_reduce_scatter_bytes(1000, 4, bits=4), quantized_reduce_scatter_bytes(
    ...     1000, 4, bits=4, block=256)
    (2512, 2064)
    """
    block = _block(bits, block)
    _check_quant(chunk_numel, world, bits, block)
    return 0 if world == 1 else world * quantized_payload_bytes(chunk_numel, bits, block)


def quantized_2hop_bytes(chunk_numel: int, shard: int, replicate: int, bits: int = 8,
                         gather_bits: int = 8, block: int | None = None) -> dict[str, int]:
    """Bytes of the two-hop quantized reduce (``quantized_reduce_scatter_2hop``) per mesh dim,
    to ``chunk_numel`` elements per rank on R = ``replicate`` replicas of S = ``shard``
    ranks: the shard dim's reduce-scatter of S chunks, then across the replicate dim a
    reduce-scatter of the chunk's R parts and an all-gather of them (``gather_bits``). With
    ``block`` None each hop takes its width's block (``QUANT_BLOCKS``: hops 1-2 ``bits``, hop
    3 ``gather_bits``), as ``quantized_reduce_scatter_2hop`` does.

    >>> quantized_2hop_bytes(1024, 2, 2, bits=4)
    {'shard': 1280, 'replicate': 1680}
    """
    gblock = _block(gather_bits, block)  # hop 3 at its own width's block unless one is given
    block = _block(bits, block)
    _check_quant(chunk_numel, shard, bits, block)
    _check_quant(chunk_numel, replicate, gather_bits, gblock)
    if replicate == 1:
        return {"shard": quantized_reduce_scatter_bytes(chunk_numel, shard, bits, block),
                "replicate": 0}
    if chunk_numel % replicate:
        raise ValueError(f"chunk_numel ({chunk_numel}) must be a multiple of replicate "
                         f"({replicate})")
    part = chunk_numel // replicate
    return {"shard": quantized_reduce_scatter_bytes(chunk_numel, shard, bits, block),
            "replicate": quantized_reduce_scatter_bytes(part, replicate, bits, block)
            + quantized_all_gather_bytes(part, replicate, gather_bits, gblock)}


def error_feedback_bytes(slice_numels: list[int], shard: int, replicate: int = 1) -> int:
    """Bytes of the error-feedback residuals per rank (``ZeroAdamW(error_feedback=True)``
    with a quantized ``reduce_dtype``): fp32, one per element a rank sends quantized. Hop 1
    sends each slice whole (``slice_numels``: each bucket's or unit's padded reduce-scatter
    input, S = ``shard`` chunks); on a mesh of R = ``replicate`` > 1 replicas hop 2 sends the
    rank's chunk, zero-padded to a multiple of R, and hop 3 1/R of that. A group of one rank
    quantizes nothing and keeps none. ``memory_stats()["ef_residual"]`` after the first step.

    >>> error_feedback_bytes([1024, 512], 2), error_feedback_bytes([1024], 2, 3)
    (6144, 6832)
    """
    for name, v in (("shard", shard), ("replicate", replicate)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 or n % shard
           for n in slice_numels):
        raise ValueError(f"slice_numels must be ints >= 0, each a multiple of shard "
                         f"({shard}), got {slice_numels!r}")
    total = 0
    for n in slice_numels:
        if shard > 1:
            total += n
        if replicate > 1:
            padded = -(-(n // shard) // replicate) * replicate
            total += padded + padded // replicate
    return 4 * total


# ------------------------------------------------------------------------------------------
# hpZ (ZeRO++ hierarchical partitioning: shard_model(hpz=True), zero/stage3/secondary.py)
# ------------------------------------------------------------------------------------------


def _check_hpz(psi: int, shard: int, replicate: int) -> None:
    for name, v in (("shard", shard), ("replicate", replicate)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if isinstance(psi, bool) or not isinstance(psi, int) or psi < 0 or psi % (shard * replicate):
        raise ValueError(f"psi must be an int >= 0 and a multiple of shard * replicate "
                         f"(the units' padded spaces), got {psi!r}")


def hpz_secondary_bytes(psi: int, shard: int, replicate: int = 1,
                        param_bytes: int = PARAM_BYTES) -> int:
    """Bytes of hpZ's secondary copy per rank: 1/S of every unit's padded flat space (``psi``
    elements in all, padding included) in the parameters' dtype, S = ``shard`` ranks per node,
    held for the model's lifetime (``memory_stats()["hpz_secondary"]``).

    >>> hpz_secondary_bytes(1024, 2, 2, 2)
    1024
    """
    _check_hpz(psi, shard, replicate)
    return psi // shard * param_bytes


def mem_hpz(psi: float, shard: int, replicate: int, k: float = DEFAULT_K) -> float:
    """Stage 3 with hpZ: (2 + 2 + K) Psi / (R S) + 2 Psi / S bytes per GPU (the primary
    partition over all R S ranks, the secondary copy of 16-bit parameters over the S of
    the node); hybrid sharding (hpz=False) holds (2 + 2 + K) Psi / S.

    >>> mem_hpz(1024, 2, 2)
    5120.0
    """
    check_psi_n(psi, shard * replicate)
    return (4 + k) * psi / (shard * replicate) + 2 * psi / shard


def hpz_comm_elements(psi: int, shard: int, replicate: int) -> dict[str, int]:
    """Elements per step and rank, counted as the paper counts (§7), of a stage-3 model
    sharded with hpZ over R = ``replicate`` nodes of S = ``shard`` ranks, each unit run
    forward and backward once (``psi``: the units' padded elements): ``"world"`` (every
    rank: the forward's all-gathers and the gradient reduce-scatters, 2 Psi), ``"shard"``
    (the node, mesh dim 1: the backward's all-gathers of the secondary shares, Psi) and
    ``"replicate"`` (nothing). A group of one rank moves nothing.

    >>> hpz_comm_elements(1024, 2, 2)
    {'world': 2048, 'shard': 1024, 'replicate': 0}
    """
    _check_hpz(psi, shard, replicate)
    return {"world": 0 if shard * replicate == 1 else 2 * psi,
            "shard": 0 if shard == 1 else psi, "replicate": 0}


def hpz_comm_bytes(psi: int, shard: int, replicate: int, param_bytes: int = PARAM_BYTES,
                   reduce_bytes: int | None = None) -> dict[str, int]:
    """Bytes of :func:`hpz_comm_elements` (unquantized): gradients in ``reduce_bytes``
    (default ``param_bytes``), parameters in ``param_bytes``.

    >>> hpz_comm_bytes(1024, 2, 2, 2, reduce_bytes=4)
    {'world': 6144, 'shard': 2048, 'replicate': 0}
    """
    e = hpz_comm_elements(psi, shard, replicate)
    g = param_bytes if reduce_bytes is None else reduce_bytes
    return {"world": e["world"] // 2 * (g + param_bytes), "shard": e["shard"] * param_bytes,
            "replicate": 0}


# ------------------------------------------------------------------------------------------
# Muon with whole-matrix owners (zerokern.optim.owner_muon, zerokern.comm.owner_exchange)
# ------------------------------------------------------------------------------------------


def muon_ns_cost(rows: int, cols: int) -> int:
    """Newton-Schulz cost of a ``rows x cols`` matrix, what owners are balanced by:
    ``rows * cols * min(rows, cols)`` (each iteration's gram matrix and two products, up to a
    constant).

    >>> muon_ns_cost(768, 3072)
    1811939328
    """
    if min(rows, cols) < 1:
        raise ValueError(f"rows and cols must be >= 1, got {rows!r}, {cols!r}")
    return rows * cols * min(rows, cols)


def _check_owned(owned_numels: list[int]) -> None:
    if not owned_numels or any(isinstance(x, bool) or not isinstance(x, int) or x < 0
                               for x in owned_numels):
        raise ValueError(f"owned_numels must be one int >= 0 per rank, got {owned_numels!r}")


def muon_exchange_elements(owned_numels: list[int]) -> dict[str, int]:
    """Elements one Muon step moves with owner exchange, given the elements each of N ranks
    owns (``MuonPlan.owned_numel``; every segment is padded to S, the largest).

    ``reduce_scatter``: the gradients to their owners, N S elements as the paper counts a
    reduce-scatter (its input); ``all_gather``: the updated matrices back, N S. Together 2 N S,
    which is stages 0-2's 2 Psi when every rank owns the same elements; ``padding`` (N S minus
    the sum) is what uneven owners add. ``wire``: elements each rank sends under
    bandwidth-optimal collectives, 2 (N - 1) S. All 0 on one rank (nothing is sent).

    >>> muon_exchange_elements([96, 64, 80])
    {'reduce_scatter': 288, 'all_gather': 288, 'wire': 384, 'padding': 48}
    """
    _check_owned(owned_numels)
    n, s = len(owned_numels), max(owned_numels)
    if n == 1:
        return {"reduce_scatter": 0, "all_gather": 0, "wire": 0, "padding": 0}
    return {"reduce_scatter": n * s, "all_gather": n * s, "wire": 2 * (n - 1) * s,
            "padding": n * s - sum(owned_numels)}


def muon_owner_memory_bytes(owned_numels: list[int], rank: int, grad_bytes: int = 4,
                            param_bytes: int = 4) -> dict[str, int]:
    """Bytes rank ``rank`` holds for Muon with owner exchange, beyond parameters and
    gradients: ``momentum`` for the elements it owns only (DDP + torch.optim.Muon keeps it
    for all of them on every rank), and the exchange's two buffers of N S elements
    (``grad_buffer`` in the gradient dtype, whose own segment receives the sum, and
    ``param_buffer`` in the parameter dtype, which the updated matrices are gathered into).
    gloo's point-to-point reduce-scatter adds (N - 1) S gradient elements while it runs
    (``Comm.scratch_peak``); NCCL's none.

    >>> muon_owner_memory_bytes([96, 64, 80], 1)
    {'momentum': 256, 'grad_buffer': 1152, 'param_buffer': 1152}
    """
    _check_owned(owned_numels)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(owned_numels):
        raise ValueError(f"rank must be in [0, {len(owned_numels)}), got {rank!r}")
    buf = len(owned_numels) * max(owned_numels)
    return {"momentum": owned_numels[rank] * grad_bytes, "grad_buffer": buf * grad_bytes,
            "param_buffer": buf * param_bytes}


def muon_shard_exchange_elements(held: list[list[int]], rank: int) -> dict[str, int]:
    """Elements rank ``rank`` sends in one Muon step at stages 1-3, where every rank holds a
    shard and the matrices go to their owners by all-to-all (zerokern.comm.shard_exchange),
    given ``held[r][o]``: the elements of owner o's matrices that rank r's shard holds (each
    row sums to rank r's Muon elements, each column o to ``owned_numels[o]``).

    ``to_owners``: what it sends the other owners (the updates, in the gradient dtype);
    ``from_owners``: what it sends back, as owner, to the ranks holding its matrices (the
    orthogonalized updates, bfloat16); ``all_to_all``: both, what ``comm_stats()`` counts
    (elements and wire alike: nothing padded, nothing kept at home sent). Summed over ranks,
    each direction moves every Muon element not held by its owner once: about 2 Psi (N-1)/N
    in all, 2 Psi (N-1)/N^2 per rank, against :func:`muon_exchange_elements`' 2 N S per rank.

    >>> muon_shard_exchange_elements([[10, 6], [4, 12]], 0)
    {'to_owners': 6, 'from_owners': 4, 'all_to_all': 10, 'wire': 10, 'padding': 0}
    """
    n = len(held)
    if n < 1 or any(len(row) != n or any(isinstance(x, bool) or not isinstance(x, int)
                                         or x < 0 for x in row) for row in held):
        raise ValueError(f"held must be an N x N table of ints >= 0, got {held!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
        raise ValueError(f"rank must be in [0, {n}), got {rank!r}")
    to = sum(held[rank][o] for o in range(n) if o != rank)
    back = sum(held[r][rank] for r in range(n) if r != rank)
    return {"to_owners": to, "from_owners": back, "all_to_all": to + back, "wire": to + back,
            "padding": 0}

def _check_held(held: list[list[int]] | None, owned_numels: list[int], rank: int) -> None:
    n = len(owned_numels)
    if held is None:
        raise ValueError("held is needed at stages 1-3 (every rank's shard of every owner's "
                         "elements)")
    if len(held) != n or any(len(row) != n for row in held):
        raise ValueError(f"held must be an N x N table for N = {n} ranks, got {held!r}")
    cols = [sum(row[o] for row in held) for o in range(n)]
    if cols != list(owned_numels):
        raise ValueError(f"held's columns sum to {cols}, owned_numels is {owned_numels}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
        raise ValueError(f"rank must be in [0, {n}), got {rank!r}")


def muon_exchange_bytes(owned_numels: list[int], stage: int,
                        held: list[list[int]] | None = None, rank: int = 0,
                        grad_bytes: int = 4, update_bytes: int = 2) -> dict[str, int]:
    """Bytes rank ``rank`` moves in one ``ZeroOptimizer(params, torch.optim.Muon)`` step's
    owner exchange (zerokern/zero/muon_step.py), as ``comm_stats()`` counts them, beside the
    stage's own collectives of the flat space.

    Stage 0 (every rank holds every element): the owners read their matrices locally and one
    all-gather of the N padded segments hands every rank the bfloat16 results
    (``all_gather``, N S elements as the paper counts it; ``wire``: (N - 1) S sent).
    Stages 1-3 (every element on one rank): two uneven all-to-alls
    (:func:`muon_shard_exchange_elements` of ``held``), the fp32 updates this rank holds of
    other owners' matrices to them, and as owner the bfloat16 results back to the ranks
    holding its matrices (``all_to_all``; ``wire`` the same: nothing padded). All 0 on one
    rank.

    Args:
        owned_numels: elements each rank owns (``MuonPlan.owned_numel``).
        stage: the ZeRO stage, 0-3.
        held: stages 1-3: ``held[r][o]``, the elements of owner o's matrices in rank r's
            shard (the layout's pieces; each column o sums to ``owned_numels[o]``); unused
            at stage 0.
        rank: whose bytes (stages 1-3; at stage 0 every rank moves the same).
        grad_bytes: bytes per element of the updates sent to their owners.
        update_bytes: bytes per element of the Newton-Schulz results sent back.

    Returns:
        ``all_gather``, ``all_to_all``, ``total`` (their sum) and ``wire``, in bytes.

    >>> muon_exchange_bytes([96, 64, 80], stage=0)
    {'all_gather': 576, 'all_to_all': 0, 'total': 576, 'wire': 384}
    >>> muon_exchange_bytes([14, 16], stage=1, held=[[10, 6], [4, 10]], rank=0)
    {'all_gather': 0, 'all_to_all': 32, 'total': 32, 'wire': 32}
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    _check_owned(owned_numels)
    n, s = len(owned_numels), max(owned_numels)
    if n == 1:
        return {"all_gather": 0, "all_to_all": 0, "total": 0, "wire": 0}
    if stage == 0:
        ag = n * s * update_bytes
        return {"all_gather": ag, "all_to_all": 0, "total": ag,
                "wire": (n - 1) * s * update_bytes}
    _check_held(held, owned_numels, rank)
    e = muon_shard_exchange_elements(held, rank)  # type: ignore[arg-type]
    a2a = e["to_owners"] * grad_bytes + e["from_owners"] * update_bytes
    return {"all_gather": 0, "all_to_all": a2a, "total": a2a, "wire": a2a}


def muon_exchange_memory_bytes(owned_numels: list[int], stage: int,
                               held: list[list[int]] | None = None, rank: int = 0,
                               grad_bytes: int = 4, update_bytes: int = 2) -> dict[str, int]:
    """Bytes rank ``rank`` holds for ``ZeroOptimizer(params, torch.optim.Muon)``'s owner
    exchange, kept between steps, beside the momentum (sharded like any state, in
    ``memory_stats()["momentum_buffer"]``), under the names ``memory_stats()`` gives them.

    Stage 0 (zerokern.comm.owner_exchange): two buffers of N S elements,
    ``muon_grad_buffer`` (the fp32 updates, whose own segment the owner orthogonalizes) and
    ``muon_param_buffer`` (the bfloat16 results every rank applies, all-gathered into it).
    Stages 1-3 (zerokern.comm.shard_exchange): this rank's segment twice,
    ``muon_grad_segment`` (fp32) and ``muon_param_segment`` (bfloat16), ``owned_numels[rank]``
    elements each, and the all-to-alls' buffers: ``muon_send`` / ``muon_back_recv`` for
    what it holds of other owners' matrices (fp32 out, bfloat16 back), ``muon_recv`` /
    ``muon_back_send`` for what other ranks hold of its own (fp32 in, bfloat16 out).

    Args:
        owned_numels: elements each rank owns (``MuonPlan.owned_numel``).
        stage: the ZeRO stage, 0-3.
        held: stages 1-3: ``held[r][o]``, the elements of owner o's matrices in rank r's
            shard (each column o sums to ``owned_numels[o]``); unused at stage 0.
        rank: whose bytes.
        grad_bytes: bytes per element of the updates (fp32: 4).
        update_bytes: bytes per element of the Newton-Schulz results (bfloat16: 2).

    Returns:
        Bytes per buffer name.

    >>> muon_exchange_memory_bytes([96, 64, 80], stage=0)
    {'muon_grad_buffer': 1152, 'muon_param_buffer': 576}
    >>> muon_exchange_memory_bytes([14, 16], stage=1, held=[[10, 6], [4, 10]], rank=0)
    ... # doctest: +NORMALIZE_WHITESPACE
    {'muon_grad_segment': 56, 'muon_param_segment': 28, 'muon_send': 24, 'muon_recv': 16,
     'muon_back_send': 8, 'muon_back_recv': 12}
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    _check_owned(owned_numels)
    if stage == 0:
        buf = len(owned_numels) * max(owned_numels)
        return {"muon_grad_buffer": buf * grad_bytes, "muon_param_buffer": buf * update_bytes}
    _check_held(held, owned_numels, rank)
    e = muon_shard_exchange_elements(held, rank)  # type: ignore[arg-type]
    own, away, home = owned_numels[rank], e["to_owners"], e["from_owners"]
    return {"muon_grad_segment": own * grad_bytes, "muon_param_segment": own * update_bytes,
            "muon_send": away * grad_bytes, "muon_recv": home * grad_bytes,
            "muon_back_send": home * update_bytes, "muon_back_recv": away * update_bytes}
