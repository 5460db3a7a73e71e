"""The kernel contract: per-step AdamW scalars, computed once on the host.

It sits below both the op router (zerokern.ops) and the kernels (zerokern.kernels), so that
imports only point down: kernels never import the router above them.

Every backend (CUDA, Triton, CPU, torch) receives the same rounded fp32 values, so the
per-element arithmetic is identical across them; the formula is the one documented in
csrc/kernels.h and matches torch.optim.AdamW(foreach=False) term by term.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class AdamScalars(NamedTuple):
    decay: float  # 1 - lr * weight_decay
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float  # lr / (1 - beta1**step)
    bc2_sqrt: float  # sqrt(1 - beta2**step)
    eps: float
    inv_grad_scale: float  # 1 / grad_scale


def adam_scalars(
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
) -> AdamScalars:
    # torch computes these in Python floats (double) and rounds once when the scalar meets
    # an fp32 tensor; doing the same keeps us bit-compatible with its per-element math.
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    return AdamScalars(
        decay=1.0 - lr * weight_decay,
        one_minus_beta1=1.0 - beta1,
        beta2=beta2,
        one_minus_beta2=1.0 - beta2,
        step_size=lr / bc1,
        bc2_sqrt=math.sqrt(bc2),
        eps=eps,
        inv_grad_scale=1.0 / grad_scale,
    )


def folds_bias_correction(moments: str, format_version: int) -> bool:
    """Whether a compressed state's update takes :func:`fold_bias_correction`'s scalars:
    bf16 moments, and int8 moments of format version 3 (``zerokern.quant.fmt_v3``).

    Neither format equals torch's AdamW bit for bit anyway (their moments are rounded), so
    their update may drop the division (issue 39); fp32 moments, and int8 versions 1 and 2,
    keep torch's arithmetic. The stored state is the same either way: a bf16 state saved
    before bf16 moments folded loads bit for bit and steps with the folded update.

    Args:
        moments: the moments' format, ``"fp32"``, ``"bf16"`` or ``"int8"``.
        format_version: the int8 format version (ignored for other moments).

    Returns:
        True where the update is the folded one.
    """
    return moments == "bf16" or (moments == "int8" and format_version == 3)


def fold_bias_correction(s: AdamScalars) -> AdamScalars:
    """The scalars of the folded update: bf16 moments' and int8 format version 3's
    (:func:`folds_bias_correction`).

    AdamW's ``p - step_size * m / (sqrt(v) / bc2_sqrt + eps)`` is, in exact arithmetic,
    ``p - (step_size * bc2_sqrt) * m / (sqrt(v) + eps * bc2_sqrt)``. The two products are
    taken here in double and rounded once to fp32 by every backend, like the other scalars,
    and ``bc2_sqrt`` becomes 1. The per-element formula stays the contract's, so the oracle
    is unchanged; since ``x / 1`` is ``x`` exactly in IEEE arithmetic, a kernel may skip that
    division and still equal the oracle bit for bit. The division is about a third of the
    update's cost on a CPU, whose dividers bound the fp32 update (issue 39).

    Args:
        s: the contract's scalars of this step (:func:`adam_scalars`).

    Returns:
        The same scalars with the bias correction of ``v`` folded into ``step_size`` and
        ``eps``, and ``bc2_sqrt == 1.0``.
    """
    return s._replace(step_size=s.step_size * s.bc2_sqrt, eps=s.eps * s.bc2_sqrt, bc2_sqrt=1.0)
