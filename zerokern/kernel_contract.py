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
