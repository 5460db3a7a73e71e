"""fused_adamw_: one in-place AdamW pass over a flat shard (fp32 master and moments, grads in
fp32/bf16/fp16, optional 16-bit param copy written in the same pass).

Anatomy: schema (torch.library custom op + fake), reference (``_reference.adamw_torch_``),
router (cuda | triton | cpu | torch), public wrapper with argument checks.
"""

from __future__ import annotations

import torch

from .. import _native
from ..kernel_contract import AdamScalars, adam_scalars
from ._backend import resolve_backend
from ._reference import adamw_torch_
from ._validate import FLOAT_DTYPES, LOW_DTYPES, check_flat, check_real

# [Note: 16-bit values are rounded to nearest even]
# Wherever fp32 becomes bf16 or fp16 (the parameter copy written in the step, bf16 moments,
# decoded communication, a checkpoint cast), the value is rounded to nearest, ties to even,
# with subnormals kept: what torch's Tensor.to(dtype) does. Every backend
# spells it so (C++: csrc/cpu_vec.h, CUDA: the __float2bfloat16_rn family, Triton:
# kernels/triton/adamw.py's _round_lp, the oracle: .to(dtype)), and that is why a 16-bit
# result is the same bits on every backend. Stochastic rounding (master="none") is the one
# exception, with its own note in zerokern/quant/philox.py.

__all__ = ["fused_adamw_"]


def _run(
    backend: str,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_lp: torch.Tensor | None,
    s: AdamScalars,
) -> None:
    if param.numel() == 0:
        return
    if backend == "torch":
        adamw_torch_(param, grad, exp_avg, exp_avg_sq, param_lp, s)
    elif backend == "triton":
        from ..kernels.triton.adamw import adamw_triton_

        adamw_triton_(param, grad, exp_avg, exp_avg_sq, param_lp, s)
    else:  # cpu and cuda share one native entry point that dispatches on the device
        _native.require(backend).adamw(param, grad, exp_avg, exp_avg_sq, param_lp, *s)


@torch.library.custom_op(
    "zerokern::fused_adamw_", mutates_args=("param", "exp_avg", "exp_avg_sq", "param_lp")
)
def _fused_adamw_op(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_lp: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float,
    backend: str,
) -> None:
    engine_adamw_(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay, step=step, grad_scale=grad_scale,
                  param_lp=param_lp, backend=backend)


@_fused_adamw_op.register_fake
def _(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    param_lp,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    grad_scale,
    backend,
) -> None:
    return None


def validate_adamw_args(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_lp: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float,
) -> None:
    """Raise TypeError/ValueError naming the first bad argument; touches nothing."""
    p = check_flat(param, "param", dtypes=(torch.float32,))
    n, dev = p.numel(), p.device
    check_flat(grad, "grad", dtypes=FLOAT_DTYPES, numel=n, device=dev)
    check_flat(exp_avg, "exp_avg", dtypes=(torch.float32,), numel=n, device=dev)
    check_flat(exp_avg_sq, "exp_avg_sq", dtypes=(torch.float32,), numel=n, device=dev)
    if param_lp is not None:
        check_flat(param_lp, "param_lp", dtypes=LOW_DTYPES, numel=n, device=dev)
    check_real(lr, "lr", lo=0.0, finite=True)
    check_real(beta1, "beta1", lo=0.0, hi=1.0, hi_open=True)
    check_real(beta2, "beta2", lo=0.0, hi=1.0, hi_open=True)
    check_real(eps, "eps", lo=0.0, finite=True)
    check_real(weight_decay, "weight_decay", lo=0.0, finite=True)
    check_real(grad_scale, "grad_scale", lo=0.0, lo_open=True)
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int (1-based), got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (1-based AdamW step), got {step}")
    # Aliasing would make the in-place update read values it already wrote.
    ptrs = {"param": p, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if param_lp is not None:
        ptrs["param_lp"] = param_lp
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for name, t in ptrs.items()]
    for i, (a, lo_a, hi_a) in enumerate(spans):
        for b, lo_b, hi_b in spans[:i]:
            if n and lo_a < hi_b and lo_b < hi_a:  # any overlap, not only the same start
                raise ValueError(f"{a} overlaps the memory of {b}")


def fused_adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    param_lp: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """One AdamW step over a flat shard, in place, matching torch.optim.AdamW(foreach=False).

    With ``g = grad / grad_scale`` at 1-based ``step``::

        param *= 1 - lr * weight_decay
        exp_avg = beta1 * exp_avg + (1 - beta1) * g
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
        param -= lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)

    ``param``, ``exp_avg``, ``exp_avg_sq``: fp32, 1-D, contiguous, same numel and device.
    ``grad``: fp32, bf16 or fp16. ``param_lp`` (bf16/fp16) receives ``param`` rounded to
    nearest even in the same pass. ``backend``: "cuda", "triton", "cpu", "torch" or None
    (fastest available for the device; ``ZEROKERN_BACKEND`` overrides).
    """
    validate_adamw_args(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param_lp,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        grad_scale=grad_scale,
    )
    chosen = resolve_backend(backend, param.device)
    _fused_adamw_op(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param_lp,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        int(step),
        float(grad_scale),
        chosen,
    )


def engine_adamw_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    grad_scale: float, param_lp: torch.Tensor | None, backend: str | None,
) -> None:
    """:func:`fused_adamw_` for the optimizer's own step: the same kernels and bits, without
    the per-call argument checks and the custom-op dispatch (about 0.1 ms of Python a call).
    Everything they check holds by construction there: the ranges come from the optimizer's
    layout (contiguous, apart in memory, of the dtypes its state was built with), and its
    param groups are checked at every step, after any clip_grad_norm_ too. Callers outside
    the optimizer use
    :func:`fused_adamw_`.

    Args:
        param: as :func:`fused_adamw_`.
        grad: as :func:`fused_adamw_`.
        exp_avg: as :func:`fused_adamw_`.
        exp_avg_sq: as :func:`fused_adamw_`.
        lr: as :func:`fused_adamw_`.
        beta1: as :func:`fused_adamw_`.
        beta2: as :func:`fused_adamw_`.
        eps: as :func:`fused_adamw_`.
        weight_decay: as :func:`fused_adamw_`.
        step: as :func:`fused_adamw_`.
        grad_scale: as :func:`fused_adamw_`.
        param_lp: as :func:`fused_adamw_`.
        backend: as :func:`fused_adamw_`.
    """
    s = adam_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     step=step, grad_scale=grad_scale)
    _run(resolve_backend(backend, param.device), param, grad, exp_avg, exp_avg_sq, param_lp, s)
