"""Optimizers a sharded model does not support yet, refused before their step writes.

Outside a forward a stage-3 parameter holds no values on this rank (a zero-stride view of one
NaN: its slice lives in the unit's shard), and the gradient of a parameter no ZeroAdamW trains
stays on ``.grad``, full and not averaged over the ranks (as a plain leaf's would). Two
cases would otherwise train wrongly or die inside torch:

- another optimizer (not ZeroAdamW) stepping such a parameter: it would train on gradients
  that are not averaged, and its first write fails inside torch ("unsupported operation:
  more than one element of the written-to tensor refers to a single memory location");
- two live ZeroAdamW on one sharded model: the model's runtime holds one step's state
  (which units reduced, the gradients' guards), so the second optimizer's step would reduce
  the first one's gradients again and fail on them.

Training part of a model with ZeroAdamW is fine in itself (the rest frozen, or added later
by ``add_param_group``, its gradient accumulating until then as torch's would), and a
ZeroAdamW built while an old one still lives (a resume) is fine until a step, so nothing is
decided when an optimizer is built: a global step pre-hook of torch's optimizers refuses
the step, before it changes anything.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from ..interop import optimizer_of
from ..registry import runtime_of_param

_HOOK: RemovableHandle | None = None
# The ZeroAdamW built on each sharded model's runtime (weakly: a dropped one does not count).
_BUILT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def install() -> None:
    """Put the checks in front of every torch optimizer's step (shard_model calls it); once."""
    global _HOOK
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_check_step)


def track(opt: Any, rt: Any) -> None:
    """A ZeroAdamW(stage=3) was built on ``rt``'s model."""
    _BUILT.setdefault(rt, weakref.WeakSet()).add(opt)


def uncovered(opt: Any) -> list[torch.nn.Parameter]:
    """The trainable stage-3 parameters in ``opt``'s groups that no ZeroAdamW trains."""
    return [p for g in opt.param_groups for p in g["params"]
            if getattr(p, "requires_grad", False) and runtime_of_param(p) is not None
            and optimizer_of(p) is None]


def _check_step(opt: Any, args: Any, kwargs: Any) -> None:
    from ..core import ZeroCore  # here: core.py imports this module

    if isinstance(opt, ZeroCore):
        rt = getattr(opt, "_rt", None)
        if rt is not None and len(_BUILT.get(rt, ())) > 1:
            _refuse_second(rt)
        return
    found = uncovered(opt)
    if not found:
        return
    names = []
    for p in found:
        rt = runtime_of_param(p)
        names.append(rt.param_names.get(id(p), f"<{tuple(p.shape)}>"))
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    raise RuntimeError(
        f"{type(opt).__name__}.step(): parameters {shown} belong to a model sharded by "
        "zerokern.shard_model (ZeRO stage 3) and no ZeroAdamW trains them. Another optimizer "
        "over stage-3 parameters is not supported yet: outside a forward each rank holds "
        "only its slice of them, and their gradients are not averaged over the ranks. Train "
        "them with the model's ZeroAdamW (in a param group of their own for other "
        "hyperparameters, or added by opt.add_param_group), or keep them out of the "
        "sharded model. Nothing was updated.")


def _refuse_second(rt: Any) -> None:
    gc.collect()  # an optimizer replaced by a new one may live on in a reference cycle
    live = len(_BUILT.get(rt, ()))
    if live > 1:
        raise RuntimeError(
            f"ZeroAdamW.step(): {live} ZeroAdamW optimizers are alive on one model sharded "
            "by zerokern.shard_model (ZeRO stage 3). More than one optimizer over a stage-3 "
            "model is not supported yet: the model's runtime holds one step's gradients for "
            "all of them. Use one ZeroAdamW with a param group per set of hyperparameters "
            "(or opt.add_param_group), and drop an optimizer you replace (del it) before "
            "stepping the new one. Nothing was updated.")
