"""Readable pure-PyTorch implementations: the "torch" backend and the test oracle.

These follow the kernels' formula (csrc/kernels.h) in fp32, one torch op per term, the way
torch.optim.AdamW(foreach=False) writes it.
"""

from __future__ import annotations

import torch

from ..kernel_contract import AdamScalars


def adamw_torch_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_lp: torch.Tensor | None,
    s: AdamScalars,
) -> None:
    g = grad.float()
    if s.inv_grad_scale != 1.0:
        g = g * s.inv_grad_scale
    param.mul_(s.decay)
    exp_avg.lerp_(g, s.one_minus_beta1)
    exp_avg_sq.mul_(s.beta2).addcmul_(g, g, value=s.one_minus_beta2)
    denom = (exp_avg_sq.sqrt() / s.bc2_sqrt).add_(s.eps)
    param.addcdiv_(exp_avg, denom, value=-s.step_size)
    if param_lp is not None:
        param_lp.copy_(param)


def sq_norm_torch(t: torch.Tensor) -> torch.Tensor:
    # Accumulate in float64 on CPU (cheap there) and fp32 elsewhere; always return fp32.
    acc = torch.float64 if t.device.type == "cpu" else torch.float32
    return t.to(acc).square().sum().to(torch.float32)


def copy_segments_torch(segments: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """segments: (src, dst) pairs of equal-numel 1-D views; dst.copy_(src) for each."""
    for src, dst in segments:
        dst.copy_(src)
