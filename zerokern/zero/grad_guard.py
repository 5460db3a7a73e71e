"""What ``p.grad`` holds between a synchronised backward and ``step()``: a ``GradGuard``.

ZeroAdamW reduces gradients into flat shards during backward, so no plain tensor on the
parameter holds the averaged gradient: stage 0-1's ``.grad`` views are local sums until the
step flushes the last buckets, stage 1 keeps only its slices averaged, stages 2-3 keep no
``.grad`` at all. torch's own utilities (``clip_grad_norm_`` imported before zerokern,
``get_total_norm`` + ``clip_grads_with_norm_``, a list filtered by ``p.grad is not None``,
``clip_grad_value_``) would then compute on local or missing gradients, silently.

As FSDP2 puts a DTensor in ``.grad`` so that torch's own norm is the global one, ZeroAdamW
puts a guard there: a tensor subclass with the parameter's shape, dtype and device and no
storage of its own. torch's utilities either compute correctly on it or are refused:

- ``torch.linalg.vector_norm(g)`` / ``torch._foreach_norm`` (2-norm): the norm of the
  parameter's averaged gradient over all ranks. Every parameter's squared norm travels in
  the step's one small all-reduce (flags and total norm), so reading it on some ranks only
  (logging on rank 0) waits for the others to reach step() and never mismatches a
  collective. A list mixing the guards of several optimizers (disjoint parts of one model)
  takes each optimizer's norms from its own reduction, in the order the optimizers first
  appear, so torch's total over them is DDP's (joint_clip.py);
- ``g.mul_(c)`` / ``g.div_(c)`` / ``torch._foreach_mul_`` by a scalar: recorded, and applied by
  ``step()`` as a clipping coefficient (every guarded parameter must get the same one);
- ``g.zero_()``: a coefficient of 0;
- anything else (``clamp_`` of ``clip_grad_value_``, reading the values): a RuntimeError that
  names ``opt.clip_grad_norm_``, raised on every rank before anything changed; torch's
  GradScaler unscaling the gradients: one that names ``loss_scale`` and ``opt.scale_loss``.

The guard lives on the parameter only from the end of a synchronised backward to the end of
``step()`` (or ``zero_grad()``, or the start of the next backward, when the real gradient goes
back so that autograd can accumulate into it). At stages 1-3 it stays after the step as a
*stale* guard (guard_set.py), standing for the gradient the step used and no rank kept whole:
it can be replaced or zeroed (``model.zero_grad()``), and anything else is refused.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

aten = torch.ops.aten

_HINT = (
    "ZeroAdamW holds this gradient reduced and sharded across the ranks (from the end of "
    "backward to step()), so torch cannot read or change its values. To clip: "
    "opt.clip_grad_norm_(max_norm) (or torch.nn.utils.clip_grad_norm_(model.parameters(), "
    "max_norm), which ZeroAdamW computes over all ranks), or ZeroAdamW(max_grad_norm=...); "
    "clipping by value is not supported. (Another optimizer stepping these parameters "
    "needs a model that no live ZeroAdamW manages)")

_NORMS = {aten.linalg_vector_norm.default, aten._foreach_norm.Scalar}
_MULS = {aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar,
         aten._foreach_mul_.Scalar, aten._foreach_mul_.Tensor, aten._foreach_mul_.List,
         aten._foreach_mul_.ScalarList, aten._foreach_div_.Scalar, aten._foreach_div_.Tensor,
         aten._foreach_div_.List, aten._foreach_div_.ScalarList}
_ZERO = {aten.zero_.default, aten._foreach_zero_.default}
_ALIASES = {aten.detach.default, aten.alias.default}
_DIVS = {aten.div_.Tensor, aten.div_.Scalar, aten._foreach_div_.Scalar,
         aten._foreach_div_.Tensor, aten._foreach_div_.List, aten._foreach_div_.ScalarList}

# torch's GradScaler unscales the gradients in place (one fused op over all of them, in
# unscale_() and in step()): named for what it is, with ZeroAdamW's own loss scaling as the
# replacement, rather than as a failed clip.
_AMP_UNSCALE = aten._amp_foreach_non_finite_check_and_unscale_.default
_SCALER_HINT = (
    "torch's GradScaler (scaler.unscale_(opt), scaler.step(opt)) unscales p.grad in place, "
    "and ZeroAdamW holds the gradients reduced and sharded across the ranks. Use ZeroAdamW's "
    'own loss scaling instead: ZeroAdamW(..., loss_scale="dynamic") (or a fixed float), '
    "opt.scale_loss(loss).backward() for scaler.scale(loss).backward(), opt.step() for "
    "scaler.step(opt), and no scaler.unscale_() or scaler.update(); clipping then works as "
    "without a scaler. A step whose gradients overflow is skipped on every rank "
    "(opt.last_step_skipped). bf16 needs no scaling")

_STALE_HINT = (
    "this is the gradient of the last step(): ZeroAdamW at stages 1-3 keeps no whole "
    "gradient after the step (it was reduced into shards and used). Read gradients between "
    "backward and step(), and clear them after the step with opt.zero_grad() or "
    "model.zero_grad()")


class GradGuard(torch.Tensor):
    """Stands in ``p.grad`` for parameter ``index`` of a ZeroAdamW (see the module docstring);
    ``owner`` is the optimizer's GuardSet (guard_set.py), held weakly, whose ``norms()`` give
    the global norms. ``zk_coef`` is the product of the scalars it was multiplied by since
    it was put there; ``zk_held`` is what ``p.grad`` held before (stages 0-1: the bucket
    view; otherwise None). (Prefixed names: a tensor already has ``real``, ``index_*``...)"""

    zk_index: int
    zk_coef: float
    zk_held: torch.Tensor | None
    zk_stale: bool  # the last step's gradient (stages 1-3), until the next backward

    @staticmethod
    def __new__(cls, p: torch.Tensor, owner: Any, index: int) -> GradGuard:
        g = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, p.shape, dtype=p.dtype, device=p.device, requires_grad=False)
        return g

    def __init__(self, p: torch.Tensor, owner: Any, index: int) -> None:
        self._owner = weakref.ref(owner)
        self.zk_index = index
        self.zk_coef = 1.0
        self.zk_held = None
        self.zk_stale = False

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"GradGuard(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}: ZeroAdamW holds this gradient sharded)")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _AMP_UNSCALE:
            raise RuntimeError(f"{func}: {_SCALER_HINT}")
        if func not in _ZERO and func not in _ALIASES and args and \
                any(g.zk_stale for g in _guards(args[0])):
            raise RuntimeError(f"{func}: {_STALE_HINT}")
        if func in _NORMS:
            return _norms(func, args, kwargs)
        if func in _MULS:
            return _scale(func, args)
        if func in _ALIASES:  # p.grad.data, p.grad.detach(): the guard itself
            return args[0]
        if func in _ZERO:
            for g in _guards(args[0]):
                g.zk_coef = 0.0
            return None if func is aten._foreach_zero_.default else args[0]
        raise RuntimeError(f"{func}: {_HINT}")


def _guards(x: Any) -> list[GradGuard]:
    xs = x if isinstance(x, (list, tuple)) else [x]
    return [g for g in xs if isinstance(g, GradGuard)]


def _owners_of(gs: list[GradGuard]) -> list[Any]:
    """The optimizers (GuardSets) the guards belong to, in the order of their first guard:
    the same order on every rank, since every rank lists the same model's gradients."""
    owners = {id(o): o for o in (g._owner() for g in gs)}
    if None in owners.values():
        raise RuntimeError("gradients of parameters of a deleted zerokern optimizer: the "
                           "reduction they stand for is gone. " + _HINT)
    return list(owners.values())


def _norms(func: Any, args: Any, kwargs: Any) -> Any:
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("scalars", 2))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if float(ord_) != 2.0 or dim not in (None, [], ()):
        raise RuntimeError(f"{func} with ord={ord_}, dim={dim}: ZeroAdamW computes the global "
                           f"2-norm of a whole gradient only. {_HINT}")
    xs = args[0] if func is aten._foreach_norm.Scalar else [args[0]]
    # One collective per optimizer and step, on every rank. Several optimizers (disjoint
    # parts of one model, e.g. torch's Muon recipe) each give their parameters' norms, each
    # global over the ranks: torch's total over them is then DDP's (joint_clip.py).
    norms = {id(o): o.norms() for o in _owners_of(_guards(xs))}

    def one(x: Any) -> torch.Tensor:
        if isinstance(x, GradGuard):
            dt = kwargs.get("dtype") or x.dtype
            own = norms[id(x._owner())]
            return torch.tensor(own[x.zk_index] * x.zk_coef, dtype=dt, device=x.device)
        return torch.linalg.vector_norm(x, 2.0)  # not ZeroAdamW's: its own, local norm

    out = [one(x) for x in xs]
    return out if func is aten._foreach_norm.Scalar else out[0]


def _scale(func: Any, args: Any) -> Any:
    xs, other = args[0], args[1]
    many = isinstance(xs, (list, tuple))
    items = list(xs) if many else [xs]
    scalars = list(other) if isinstance(other, (list, tuple)) else [other] * len(items)
    for x, c in zip(items, scalars):
        if isinstance(c, GradGuard):
            raise RuntimeError(f"{func} by a gradient: {_HINT}")
        c = _as_float(c)
        if func in _DIVS:
            c = 1.0 / c if c != 0 else math.inf
        if isinstance(x, GradGuard):
            x.zk_coef *= c
        else:
            x.mul_(c)  # a plain tensor mixed into the list (not ZeroAdamW's): as torch would
    return None if many else xs


_last_scalar: tuple[Any, int, float] | None = None


def _as_float(c: Any) -> float:
    """The scalar of a clip coefficient. torch's per-tensor path multiplies every gradient
    by the same 0-d tensor: its value is read once (one device sync on CUDA, not one per
    parameter)."""
    global _last_scalar
    if not torch.is_tensor(c):
        return float(c)
    last = _last_scalar
    if last is not None and last[0]() is c and last[1] == c._version:
        return last[2]
    v = float(c.item())
    _last_scalar = (weakref.ref(c), c._version, v)
    return v
