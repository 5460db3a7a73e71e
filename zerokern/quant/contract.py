"""The fp32 AdamW update of the kernel contract (csrc/kernels.h), in exact pure PyTorch.

The fused kernels (C++ AVX-512/AVX2/scalar, CUDA, Triton) compute one fp32 AdamW update with
three fused multiply-adds (the lerp, the ``exp_avg_sq`` update and the parameter update) and
every other operation rounded on its own. ``torch``'s own ops round differently (about one ulp
apart), so the compressed-state oracle cannot call them and still be the kernels' bitwise
reference: it spells the contract out here, with :func:`fma32` an exact fp32 fma.

:func:`fma32` is exact: ``a*b`` is exact in float64 (two 24-bit significands), so
``s = a*b + c`` in float64 is the exact value rounded once. Casting ``s`` to fp32 rounds a
second time, which differs from one rounding only when ``s`` lands exactly on a midpoint
between two fp32 values while the exact value does not; there the exact residual of the
float64 sum (TwoSum, exact for doubles) says which neighbour is right.
"""

from __future__ import annotations

import torch

from ..kernel_contract import AdamScalars

_F32 = torch.float32
_F64 = torch.float64


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to the nearest fp32 (ties to even), elementwise.

    Args:
        a, b, c: fp32 tensors (broadcast together).

    Returns:
        A new fp32 tensor: what a hardware fp32 fma returns (no flush-to-zero).
    """
    a64, b64, c64 = a.to(_F64), b.to(_F64), c.to(_F64)
    ab = a64 * b64  # exact
    s = ab + c64
    r = s.to(_F32)
    r64 = r.to(_F64)
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    down = torch.nextafter(r, torch.full_like(r, float("-inf")))
    other = torch.where(r64 < s, up, torch.where(r64 > s, down, r))
    # An fp32 overflow of a finite s: r is +-inf, measured as +-2**128 for the midpoint test.
    r64m = torch.where(torch.isinf(r64) & torch.isfinite(s), torch.copysign(
        torch.full_like(s, 2.0**128), s), r64)
    mid = torch.isfinite(s) & (r64m != s) & ((r64m + other.to(_F64)) / 2 == s)
    if not bool(mid.any()):
        return r
    # TwoSum: s + err == ab + c exactly.
    bb = s - ab
    err = (ab - (s - bb)) + (c64 - bb)
    lo, hi = torch.minimum(r, other), torch.maximum(r, other)
    fixed = torch.where(err > 0, hi, lo)
    return torch.where(mid & (err != 0), fixed, r)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    # torch's CPU sqrt is not always correctly rounded (a vector library within 0.5001 ulp);
    # through float64 it is: 53 >= 2 * 24 + 2 bits, so the second rounding is harmless.
    return x.to(_F64).sqrt().to(_F32)


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Correctly rounded for the same reason, whatever kernel torch picks for fp32 division.
    return (a.to(_F64) / b.to(_F64)).to(_F32)


def _f(x: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(x, dtype=_F32, device=like.device)


def adamw_contract_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, param_lp: torch.Tensor | None,
                    s: AdamScalars) -> None:
    """One fp32 AdamW update in place, rounded exactly as the fused kernels round it.

    Args:
        param, exp_avg, exp_avg_sq: fp32 tensors of one shape, updated in place.
        grad: same shape, any float dtype (widened to fp32 exactly).
        param_lp: None, or a 16-bit tensor that receives the new param rounded to nearest
            even (the signature of ``zerokern.ops._reference.adamw_torch_``).
        s: ``zerokern.kernel_contract.adam_scalars(...)`` of the step.
    """
    g = grad.to(_F32) * _f(s.inv_grad_scale, param)
    p = param * _f(s.decay, param)
    m, v = exp_avg, exp_avg_sq
    d = g - m
    w = _f(s.one_minus_beta1, param)
    if float(w) < 0.5:  # decided on the fp32 weight, as the kernels see it
        m_new = fma32(w, d, m)
    else:
        m_new = fma32(-d, _f(1.0, param) - w, g)
    v_new = fma32(_f(s.one_minus_beta2, param) * g, g, v * _f(s.beta2, param))
    denom = _div(_sqrt(v_new), _f(s.bc2_sqrt, param)) + _f(s.eps, param)
    p_new = fma32(-_f(s.step_size, param), _div(m_new, denom), p)
    param.copy_(p_new)
    exp_avg.copy_(m_new)
    exp_avg_sq.copy_(v_new)
    if param_lp is not None:
        param_lp.copy_(p_new)
