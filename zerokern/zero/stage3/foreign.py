"""Optimizers a sharded model does not support, refused before their step writes.

Outside a forward a stage-3 parameter holds no values on this rank (a zero-stride view of one
NaN: its slice lives in the unit's shard), and the gradient of a parameter no zerokern
optimizer trains stays on ``.grad``, full and not averaged over the ranks (as a plain leaf's
would). Two cases would otherwise train wrongly or die inside torch:

- another optimizer (not zerokern's) stepping such a parameter: it would train on gradients
  that are not averaged, and its first write fails inside torch ("unsupported operation:
  more than one element of the written-to tensor refers to a single memory location");
- a zerokern optimizer superseded by a newer one built over all of its parameters (a resume
  while the old object still lives): the new one trains them now (owners.py).

Several zerokern optimizers over disjoint parameters of one model are fine (owners.py), and so
is training part of a model (the rest frozen, or added later by ``add_param_group``, its
gradient accumulating until then as torch's would), so nothing is decided when an optimizer
is built: a global step pre-hook of torch's optimizers refuses the step, before it changes
anything.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ..interop import optimizer_of
from ..registry import runtime_of_param
from .owners import is_superseded, superseded_error

_HOOK: RemovableHandle | None = None


def install() -> None:
    """Put the checks in front of every torch optimizer's step (shard_model calls it); once."""
    global _HOOK
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_check_step)


def uncovered(opt: Any) -> list[torch.nn.Parameter]:
    """The trainable stage-3 parameters in ``opt``'s groups that no zerokern optimizer
    trains."""
    return [p for g in opt.param_groups for p in g["params"]
            if getattr(p, "requires_grad", False) and runtime_of_param(p) is not None
            and optimizer_of(p) is None]


def _check_step(opt: Any, args: Any, kwargs: Any) -> None:
    from ..core import ZeroCore  # here: core.py imports this module

    if isinstance(opt, ZeroCore):
        if getattr(opt, "_rt", None) is not None and is_superseded(opt):
            raise superseded_error(opt)
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
        "zerokern.shard_model (ZeRO stage 3) and no zerokern optimizer trains "
        "them. A torch optimizer over stage-3 parameters is not supported: outside a forward "
        "each rank holds only its slice of them, and their gradients are not averaged over "
        "the ranks. Train them with a zerokern optimizer: the model's ZeroAdamW (a param "
        "group of their own for other hyperparameters, or opt.add_param_group), or "
        f"zerokern.ZeroOptimizer(params, torch.optim.{type(opt).__name__}, stage=3) over "
        "them, or keep them out of the sharded model. Nothing was updated.")
