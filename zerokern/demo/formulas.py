"""What the ZeRO paper says a rank holds and sends per step, as pure functions (no torch).

Model-state bytes per rank (paper §5.4) with ``p``-byte parameters and gradients and K bytes
of optimizer state per parameter: K = 12 for 16-bit parameters (fp32 master weight, momentum,
variance), K = 8 for fp32 parameters (momentum and variance; the fp32 parameter is its own
master). Replicated bytes per parameter, then bytes per parameter divided over N ranks:

    stage 0  DP         (2p + K) Psi
    stage 1  P_os       2p Psi + K Psi / N
    stage 2  P_os+g     p Psi + (p + K) Psi / N
    stage 3  P_os+g+p   (2p + K) Psi / N

For p = 2 these are the paper's 16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N and 16 Psi/N
(zerokern.cli.estimate.model_state_bytes). Communication per step (paper §7): 2 Psi elements
for stages 0-2 (all-reduce = reduce-scatter + all-gather), 3 Psi for stage 3 (parameters
all-gathered in forward and in backward, gradients reduce-scattered); nothing with one rank.
"""

from __future__ import annotations

from fractions import Fraction

__all__ = [
    "STAGE_NAMES",
    "expected_model_state_bytes",
    "expected_comm_elements",
    "optimizer_bytes_per_param",
    "state_formula_text",
    "zerokern_extra_bytes",
]

STAGE_NAMES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


def _check(stage: int, psi: int, world: int, param_bytes: int) -> None:
    if stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if psi < 0 or world < 1:
        raise ValueError(f"need psi >= 0 and world >= 1, got psi={psi}, world={world}")
    if param_bytes not in (2, 4):
        raise ValueError(f"param_bytes must be 2 (fp16/bf16) or 4 (fp32), got {param_bytes!r}")


def optimizer_bytes_per_param(param_bytes: int) -> int:
    """K: fp32 master + two fp32 moments for 16-bit params; the two moments for fp32 params."""
    return 12 if param_bytes < 4 else 8


def _coefficients(stage: int, param_bytes: int) -> tuple[int, int]:
    """(replicated bytes per parameter, bytes per parameter sharded over N)."""
    p, k = param_bytes, optimizer_bytes_per_param(param_bytes)
    return {0: (2 * p + k, 0), 1: (2 * p, k), 2: (p, p + k), 3: (0, 2 * p + k)}[stage]


def _exact(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def expected_model_state_bytes(stage: int, psi: int, world: int, param_bytes: int) -> int | float:
    """Paper §5.4 model-state bytes per rank (an int whenever psi is divisible by world).

    >>> [expected_model_state_bytes(s, 8, 4, 2) for s in range(4)]  # the paper's tiny example
    [128, 56, 44, 32]
    """
    _check(stage, psi, world, param_bytes)
    rep, shard = _coefficients(stage, param_bytes)
    return _exact(rep * Fraction(psi) + shard * Fraction(psi, world))


def state_formula_text(stage: int, param_bytes: int) -> str:
    """The formula as text, e.g. '4Ψ+12Ψ/N'."""
    rep, shard = _coefficients(stage, param_bytes)
    parts = ([f"{rep}Ψ"] if rep else []) + ([f"{shard}Ψ/N"] if shard else [])
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
