"""One clip over several zerokern optimizers: ``clip_grad_norm_(model.parameters(), c)`` when
the model's parameters are split between optimizers (torch's Muon recipe: the hidden matrices
to one, the rest to another). DDP + torch clips every listed gradient by the 2-norm over all
of them; zerokern does the same.

Each optimizer's step reduction already all-reduces its squared norm (reduction.py), so each
optimizer's norm is global over the ranks, and the total is the root of the sum of their
squares, with no collective of its own. Every optimizer then records the same clipping
coefficient, applied by its ``step()``. The reductions run in the order the optimizers first
appear in the list, which is the same on every rank (the same model's parameters).

Over one stage-3 model the same holds: its backward reduced every optimizer's gradients into
the model's slices, and each reduction reads its own optimizer's pieces of them
(stage3/owners.py).

What cannot be exact is refused before anything is reduced: a list holding part of one
optimizer's parameters (torch would clip those gradients alone, by their norm; an optimizer's
sharded gradients take one coefficient), and gradients no zerokern optimizer reduced (local
to the rank: DDP would have averaged them).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .validate import finite_ge0


def check_clip_args(max_norm: Any, norm_type: Any, who: str) -> None:
    """The arguments of a clip by the global norm (the same checks as ``opt.clip_grad_norm_``):
    the 2-norm only, ``max_norm`` a number >= 0 (inf: the norm alone, no clipping)."""
    if float(norm_type) != 2.0:
        raise ValueError(f"norm_type: {who} clips by the 2-norm only, got {norm_type!r}")
    if not (isinstance(max_norm, (int, float)) or torch.is_tensor(max_norm)) or \
            not (finite_ge0(max_norm) or float(max_norm) == math.inf):
        raise ValueError(f"max_norm must be a number >= 0 (inf: no clipping), got "
                         f"{max_norm!r}")


def check_covered(params: list[Any], opts: list[Any], optimizer_of: Any) -> None:
    """Every optimizer with a parameter in ``params`` has all of its parameters there, and no
    other parameter in the list has a gradient; refused otherwise, before anything changes."""
    names = ", ".join(type(o).__name__ for o in opts)
    given = {id(p) for p in params}
    for o in opts:
        missing = [p for p in o.managed_params if id(p) not in given]
        if missing:
            raise ValueError(
                f"clip_grad_norm_: the list holds part of the parameters of a "
                f"{type(o).__name__} ({len(missing)} of its {len(o.managed_params)} are not "
                "in it). torch would clip the listed gradients alone, by their norm; an "
                "optimizer's sharded gradients take one coefficient, so zerokern clips whole "
                "optimizers only. Pass all the parameters of every optimizer involved (e.g. "
                "model.parameters(): one norm over all of them), or call "
                "opt.clip_grad_norm_(max_norm) on one")
    others = [p for p in params if optimizer_of(p) is None and p.grad is not None]
    if others:
        raise ValueError(
            f"clip_grad_norm_: {len(others)} of the listed parameters have a gradient and "
            f"no zerokern optimizer ({names}) trains them: that gradient is this rank's "
            "alone (no DDP averaged it), so the norm would differ by rank. Train them with "
            "a zerokern optimizer (a param group of their own), or leave them out of the "
            "list")


def clip_joint(opts: list[Any], max_norm: float, norm_type: float = 2.0,
               error_if_nonfinite: bool = False) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over all the parameters of ``opts`` (zerokern
    optimizers on disjoint parameters): returns the 2-norm over all of their averaged
    gradients (a 0-d tensor on the first one's device), and every optimizer clips by it at
    its ``step()``. A collective of each optimizer, in ``opts``' order: call it on every
    rank, between the last backward and the steps."""
    check_clip_args(max_norm, norm_type, "clip_grad_norm_ over several optimizers")
    # An optimizer over several dtypes (mixed.py) is its parts, one reduction each.
    opts = [q for o in opts for q in getattr(o, "_parts", [o])]
    # Each reduction is global over the ranks (and over the replicas of a 2-D mesh); its
    # norm is unscaled (loss scale divided out) and taken after the clips recorded so far.
    reds = [o._reduce_grads(need_norm=True) for o in opts]
    total = math.sqrt(math.fsum((r.norm * r.clip) ** 2 for r in reds))
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            "The total norm of order 2.0 for gradients from `parameters` is non-finite, so "
            "it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")
    if float(max_norm) != math.inf:
        # torch's coefficient, the same for every gradient: max_norm / (total + 1e-6),
        # at most 1 (a NaN total gives NaN: NaN gradients, as torch's).
        coef = float(max_norm) / (total + 1e-6)
        coef = coef if math.isnan(coef) else min(1.0, coef)
        for r in reds:
            r.clip_before = r.clip
            r.clip *= coef
    return torch.tensor(total, device=opts[0].device)
