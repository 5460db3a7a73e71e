"""Muon's update of one owned matrix, bit for bit what ``torch.optim.Muon`` does to it.

:func:`muon_update_` hands the matrix to torch's own per-parameter step
(``torch.optim._muon._single_tensor_muon``), so whatever formula the installed torch uses
(2.14's NS always runs ``addmm``; some releases have a ``use_addmm`` switch instead) is the
one applied. Where that private function is missing or takes other arguments, it falls back
to a copy of torch 2.14's step (momentum ``lerp``, Nesterov ``lerp``, Newton-Schulz in
bfloat16, decoupled weight decay, shape-adjusted learning rate).

:func:`muon_update_batched_` updates ``k`` same-shape matrices with one batched
Newton-Schulz (``bmm``/``baddbmm`` on a ``(k, rows, cols)`` stack). The elementwise steps
(momentum, Nesterov, weight decay, the final add) still run matrix by matrix, on tensors of
the same shape as torch's, and the norm of each matrix is taken on its own; only the matrix
products are batched. On the CPU the batched products are bitwise equal to torch's per-matrix
ones (tests/test_muon_update.py checks shapes up to 256 x 192, tall and wide); on CUDA the
BLAS may pick another kernel for a batch, so batching is opt-in.

:func:`check_muon_params` refuses what ``torch.optim.Muon`` refuses, with torch's own error,
by building a ``torch.optim.Muon`` on the parameters first.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch

try:  # private API: guarded, with the copy below as the fallback
    from torch.optim import _muon as _torch_muon
except ImportError:  # pragma: no cover - every supported torch (>= 2.11) has it
    _torch_muon = None

# torch.optim.Muon's defaults (Keller Jordan's constants, as torch spells them).
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Newton-Schulz coefficients (a, b, c) of ``torch.optim.Muon``."""
DEFAULT_EPS = 1e-7
"""``torch.optim.Muon``'s ``eps``: the floor of the norm the matrix is divided by."""
DEFAULT_NS_STEPS = 5
"""``torch.optim.Muon``'s ``ns_steps``."""


def _params_of(fn: Any) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return frozenset()


_STEP_KW = frozenset({"lr", "weight_decay", "momentum", "nesterov", "ns_coefficients",
                      "ns_steps", "eps", "adjust_lr_fn", "has_complex"})
_TORCH_STEP = getattr(_torch_muon, "_single_tensor_muon", None)
_TORCH_STEP_KW = _params_of(_TORCH_STEP) if _TORCH_STEP is not None else frozenset()
# torch's step is used only when it takes every argument we pass (use_addmm is optional).
_USE_TORCH = _TORCH_STEP is not None and _STEP_KW <= _TORCH_STEP_KW
_TORCH_NS = getattr(_torch_muon, "_zeropower_via_newtonschulz", None)
_HAS_ADDMM_FLAG = "use_addmm" in _params_of(_TORCH_NS) if _TORCH_NS is not None else False


def _muon_default(name: str, fallback: Any) -> Any:
    cls = getattr(torch.optim, "Muon", None)
    if cls is None:  # pragma: no cover
        return fallback
    p = inspect.signature(cls.__init__).parameters.get(name)
    return fallback if p is None else p.default


def _addmm(use_addmm: bool | None) -> bool:
    """Whether torch's Newton-Schulz uses ``addmm``: always where it has no switch (2.14),
    else the switch (``None``: ``torch.optim.Muon``'s default)."""
    if not _HAS_ADDMM_FLAG:
        return True
    return bool(_muon_default("use_addmm", False) if use_addmm is None else use_addmm)


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """The learning rate torch's Muon applies to the orthogonalized update of a ``shape``
    matrix (torch's ``_adjust_lr`` where it exists, else a copy of torch 2.14's).

    Args:
        lr: the learning rate.
        adjust_lr_fn: ``None`` or ``"original"`` (``sqrt(max(1, rows / cols))``),
            ``"match_rms_adamw"`` (``0.2 * sqrt(max(rows, cols))``), or what else the
            installed torch accepts.
        shape: ``(rows, cols)``.

    Returns:
        The adjusted learning rate.
    """
    fn = getattr(_torch_muon, "_adjust_lr", None)
    if fn is not None:
        return fn(lr, adjust_lr_fn, torch.Size(shape))
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, a / b))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(a, b))
    elif adjust_lr_fn == "spectral_unclamped":
        ratio = math.sqrt(a / b)
    else:
        ratio = 1.0
    return lr * ratio


def _scalar(lr: Any) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else lr


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.ndim != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {tuple(t.shape)}")


def muon_update_(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor, *,
                 lr: float, weight_decay: float, momentum: float, nesterov: bool,
                 ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                 eps: float = DEFAULT_EPS, ns_steps: int = DEFAULT_NS_STEPS,
                 adjust_lr_fn: str | None = None, use_addmm: bool | None = None) -> None:
    """One Muon step on one matrix, in place: what ``torch.optim.Muon.step()`` does to a
    parameter with this gradient and momentum buffer, bit for bit.

    Args:
        param: the matrix (a parameter, or a view of a block of one), updated in place.
        grad: its (averaged) gradient, same shape; not modified.
        momentum_buffer: its momentum, same shape, zeros before the first step; updated in
            place.
        lr: the learning rate.
        weight_decay: decoupled weight decay: ``param *= 1 - lr * weight_decay``.
        momentum: the momentum factor.
        nesterov: use Nesterov momentum.
        ns_coefficients: the Newton-Schulz coefficients ``(a, b, c)``.
        eps: the floor of the norm the update is divided by before Newton-Schulz.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: how the learning rate is scaled by the shape (:func:`adjust_lr`).
        use_addmm: torch releases with a ``use_addmm`` switch: its value (``None``: their
            default); ignored by torch releases without one.

    Raises:
        ValueError: ``param``, ``grad`` or ``momentum_buffer`` is not 2-D or their shapes
            differ (before anything is modified).
    """
    for name, t in (("param", param), ("grad", grad), ("momentum_buffer", momentum_buffer)):
        _check_2d(name, t)
    if not param.shape == grad.shape == momentum_buffer.shape:
        raise ValueError(f"param, grad and momentum_buffer must have one shape, got "
                         f"{tuple(param.shape)}, {tuple(grad.shape)}, "
                         f"{tuple(momentum_buffer.shape)}")
    kw: dict[str, Any] = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                              nesterov=nesterov, ns_coefficients=ns_coefficients,
                              ns_steps=ns_steps, eps=eps, adjust_lr_fn=adjust_lr_fn)
    with torch.no_grad():
        if _USE_TORCH:
            if "use_addmm" in _TORCH_STEP_KW:
                kw["use_addmm"] = _addmm(use_addmm)
            _TORCH_STEP([param], [grad], [momentum_buffer], has_complex=False, **kw)
        else:
            _fallback_update_(param, grad, momentum_buffer, **kw)


def _fallback_update_(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, *,
                      lr: Any, weight_decay: float, momentum: float, nesterov: bool,
                      ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float,
                      adjust_lr_fn: str | None) -> None:
    """torch 2.14's ``_single_tensor_muon`` on one matrix, op for op."""
    lr = _scalar(lr)
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if nesterov else buf
    update = newton_schulz(update.unsqueeze(0), ns_coefficients, ns_steps, eps,
                           _addmm(None))[0]
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-adjust_lr(lr, adjust_lr_fn, param.shape))


def newton_schulz(stack: torch.Tensor, ns_coefficients: tuple[float, float, float],
                  ns_steps: int, eps: float, use_addmm: bool = True) -> torch.Tensor:
    """torch's Newton-Schulz orthogonalization of each matrix of a ``(k, rows, cols)`` stack,
    in bfloat16, with the matrix products batched.

    Each matrix's Frobenius norm is taken on its own (as torch takes it), the products are
    ``bmm``/``baddbmm`` in torch's order. Like torch's, it divides a bfloat16 ``stack`` by
    the norms in place (``.bfloat16()`` of a bfloat16 tensor is the tensor itself).

    Args:
        stack: ``(k, rows, cols)``, any float dtype (converted to bfloat16 as torch does).
        ns_coefficients: ``(a, b, c)``.
        ns_steps: iterations, below 100 (torch's limit).
        eps: the floor of each matrix's norm.
        use_addmm: the ``addmm`` formulation (torch 2.14; ``False``: torch's other one).

    Returns:
        The ``(k, rows, cols)`` bfloat16 result.

    Raises:
        ValueError: ``stack`` is not 3-D, ``ns_steps`` is 100 or more, or
            ``ns_coefficients`` is not three numbers.
    """
    if stack.ndim != 3:
        raise ValueError(f"stack must be (k, rows, cols), got shape {tuple(stack.shape)}")
    if ns_steps >= 100:
        raise ValueError("ns_steps must be below 100 (torch.optim.Muon's limit)")
    if len(ns_coefficients) != 3:
        raise ValueError(f"ns_coefficients must be (a, b, c), got {ns_coefficients!r}")
    a, b, c = ns_coefficients
    x = stack.bfloat16()
    tall = stack.size(1) > stack.size(2)
    if tall:
        x = x.mT
    # One norm per matrix, each a 2-D reduction like torch's (a batched vector_norm could
    # sum in another order). In place, as torch divides: a bfloat16 input is divided itself.
    norms = torch.stack([m.norm() for m in x]).clamp(min=eps)
    x.div_(norms.view(-1, 1, 1))
    for _ in range(ns_steps):
        gram = torch.bmm(x, x.mT)
        if use_addmm:
            gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, gram_update, x, beta=a)
        else:
            gram_update = b * gram + c * torch.bmm(gram, gram)
            x = a * x + torch.bmm(gram_update, x)
    return x.mT if tall else x


def muon_update_batched_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                         momentum_buffers: Sequence[torch.Tensor], *, lr: float,
                         weight_decay: float, momentum: float, nesterov: bool,
                         ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                         eps: float = DEFAULT_EPS, ns_steps: int = DEFAULT_NS_STEPS,
                         adjust_lr_fn: str | None = None,
                         use_addmm: bool | None = None) -> None:
    """:func:`muon_update_` on ``k`` same-shape matrices with one batched Newton-Schulz.

    Args:
        params: the matrices, updated in place.
        grads: their gradients (e.g. the views of one :class:`~zerokern.optim.muon_plan.Batch`
            of the received segment); not modified.
        momentum_buffers: their momentum, updated in place.
        lr: as :func:`muon_update_`.
        weight_decay: as :func:`muon_update_`.
        momentum: as :func:`muon_update_`.
        nesterov: as :func:`muon_update_`.
        ns_coefficients: as :func:`muon_update_`.
        eps: as :func:`muon_update_`.
        ns_steps: as :func:`muon_update_`.
        adjust_lr_fn: as :func:`muon_update_`.
        use_addmm: as :func:`muon_update_`.

    Raises:
        ValueError: the lists differ in length or are empty, or a tensor is not 2-D or not of
            the first parameter's shape (before anything is modified).
    """
    k = len(params)
    if k == 0 or len(grads) != k or len(momentum_buffers) != k:
        raise ValueError(f"params, grads and momentum_buffers must be equally long and not "
                         f"empty, got {k}, {len(grads)}, {len(momentum_buffers)}")
    shape = params[0].shape
    for name, ts in (("params", params), ("grads", grads),
                     ("momentum_buffers", momentum_buffers)):
        for i, t in enumerate(ts):
            _check_2d(f"{name}[{i}]", t)
            if t.shape != shape:
                raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}, expected "
                                 f"{tuple(shape)} (a batch is one shape)")
    lr = _scalar(lr)
    with torch.no_grad():
        stack = torch.empty((k, *shape), dtype=grads[0].dtype, device=grads[0].device)
        for i in range(k):
            # Elementwise steps on tensors of torch's shape: the same loops, the same bits.
            momentum_buffers[i].lerp_(grads[i], 1 - momentum)
            if nesterov:
                torch.lerp(grads[i], momentum_buffers[i], momentum, out=stack[i])
            else:
                stack[i].copy_(momentum_buffers[i])
        update = newton_schulz(stack, ns_coefficients, ns_steps, eps, _addmm(use_addmm))
        if not nesterov and stack.dtype == torch.bfloat16:
            # torch orthogonalizes the bfloat16 buffer itself, whose in-place division by
            # its norm then stays in the momentum (torch.optim.Muon does this): so here.
            for i in range(k):
                momentum_buffers[i].copy_(stack[i])
        step = adjust_lr(lr, adjust_lr_fn, shape)
        for i in range(k):
            params[i].mul_(1 - lr * weight_decay)
            params[i].add_(update[i], alpha=-step)


def check_muon_params(params: Sequence[torch.Tensor], **hyper: Any) -> None:
    """Refuse what ``torch.optim.Muon`` refuses, with its own error: builds one on
    ``params`` with ``hyper`` (and drops it).

    Args:
        params: the parameters Muon is to update.
        **hyper: ``torch.optim.Muon``'s keyword arguments (``lr``, ``weight_decay``, ...).

    Raises:
        ValueError: torch's own, e.g. "Muon only supports 2D parameters whereas we found a
            parameter with size: ..." for a parameter that is not 2-D.
    """
    torch.optim.Muon(list(params), **hyper)


__all__ = ["DEFAULT_EPS", "DEFAULT_NS_COEFFICIENTS", "DEFAULT_NS_STEPS", "adjust_lr",
           "check_muon_params", "muon_update_", "muon_update_batched_", "newton_schulz"]
