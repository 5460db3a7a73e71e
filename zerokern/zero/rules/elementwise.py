"""Which torch optimizer classes ZeroOptimizer shards, and the rule each one is stepped with.

zerokern splits every parameter at any element between ranks, so an update can run on a
rank's flat shard only if each element's new value and state depend on nothing but that
element's value, gradient and state, the group's hyperparameters, and per-parameter scalars
that do not depend on the values (a step count, NAdam's ``mu_product``): "element-wise". That
cannot be read off a class, so it is declared:

- torch's element-wise classes (``ELEMENTWISE``) are known; ``torch.optim.AdamW`` itself runs
  zerokern's fused AdamW kernels (the ``ZeroAdamW`` path), the others their own ``step()``
  over the flat shard (``TorchClassRule``);
- a subclass that keeps one of their ``step`` methods (it only changes defaults, or adds
  methods) is element-wise as its base is;
- any other class declares itself with the class attribute ``zerokern_elementwise = True``,
  or the caller with ``ZeroOptimizer(..., elementwise=True)``;
- classes that are known not to be element-wise (``REFUSED``: LBFGS, SparseAdam, Adafactor)
  are refused whatever is declared, with what to do instead;
- ``torch.optim.Muon`` (and a subclass keeping its ``step``) is not element-wise either, but
  only its Newton-Schulz reads a whole matrix: it gets its own rule (``MuonRule``, muon.py),
  whose matrices each have one owner rank (zero/muon_step.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .adamw import ADAMW
from .base import UpdateRule
from .muon import MuonRule, is_muon
from .torch_class import TorchClassRule
from .torch_class import class_name as _name

_optim = torch.optim
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = tuple(
    c for c in (getattr(_optim, n, None) for n in (
        "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta",
        "Rprop", "ASGD")) if c is not None)
"""torch's optimizers whose update is element-wise: run on the flat shard."""

REFUSED: dict[str, str] = {
    "LBFGS": "it runs a line search over the whole model through its closure and keeps a "
             "history of whole flattened gradients, so no rank can step its shard alone; "
             "use an element-wise optimizer (SGD, Adam, ...) under ZeroOptimizer, or DDP "
             "with LBFGS",
    "SparseAdam": "it steps sparse gradients, while zerokern reduces dense flat gradients; "
                  "use torch.optim.Adam (dense) under ZeroOptimizer",
    "Adafactor": "it factors the second moment of a matrix into row and column statistics, "
                 "which read whole rows and columns, not single elements; use Adam or AdamW "
                 "under ZeroOptimizer, or DDP with Adafactor",
}
"""torch classes known not to be element-wise, with why and what to do."""

ATTRIBUTE = "zerokern_elementwise"
"""The class attribute by which an optimizer class declares its update element-wise."""


def _step_owner(cls: type) -> type | None:
    """The class in ``cls``'s MRO that defines the ``step`` it runs."""
    return next((c for c in cls.__mro__ if "step" in c.__dict__), None)


def check_elementwise(cls: Any, elementwise: bool) -> None:
    """Refuse, naming it, an ``optimizer_class`` ZeroOptimizer cannot step on a flat shard."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass (the class, "
                        f"not an instance), got {cls!r}")
    if not isinstance(elementwise, bool):
        raise TypeError(f"elementwise must be True or False, got {elementwise!r}")
    from ..any_optimizer import ZeroOptimizer  # here: that module imports this one

    if issubclass(cls, ZeroOptimizer):
        raise TypeError(f"optimizer_class: {cls.__name__} is zerokern's own; pass the torch "
                        "class (e.g. torch.optim.AdamW)")
    owner = _step_owner(cls)
    if is_muon(cls):
        return
    for c in cls.__mro__:
        why = REFUSED.get(c.__name__) if c.__module__.startswith("torch.optim") else None
        if why is not None and (c is owner or owner not in ELEMENTWISE):
            raise ValueError(f"optimizer_class={_name(cls)} is not supported by "
                             f"ZeroOptimizer: {why}")
    if owner in ELEMENTWISE or elementwise or getattr(cls, ATTRIBUTE, False) is True:
        return
    raise ValueError(
        f"optimizer_class={_name(cls)}: ZeroOptimizer cannot tell whether its update is "
        "element-wise (each element's new value and state depend only on that element's "
        "value, gradient and state, the group's hyperparameters and per-parameter scalars "
        "such as a step count), which sharding a parameter at any element needs. If it is, "
        f"declare it: set the class attribute {ATTRIBUTE} = True, or pass "
        f"ZeroOptimizer(..., elementwise=True); if not, train it with DDP{_muon_hint(cls)}")


def _muon_hint(cls: type) -> str:
    """A script's own Muon (modded-nanogpt's, the Muon package's) orthogonalizes whole
    matrices, so declaring it element-wise would train silently wrong; torch's Muon is the
    same update (Newton-Schulz in bfloat16, Nesterov momentum) and is sharded."""
    if "muon" not in cls.__name__.lower():
        return ""
    return (". For a Muon (Newton-Schulz on whole matrices: not element-wise, do not declare "
            "it), use torch.optim.Muon, which ZeroOptimizer shards with whole-matrix owners "
            "(its defaults differ from most scripts' Muon: weight_decay=0.1, lr=1e-3; see "
            "docs/other-optimizers.md)")


def rule_for(cls: type[torch.optim.Optimizer], given: Mapping[str, Any],
             elementwise: bool = False) -> UpdateRule:
    """The rule stepping ``cls`` with the hyperparameters ``given``: AdamW's fused rule for
    ``torch.optim.AdamW`` itself (without ``amsgrad`` or ``maximize``), else a
    ``MuonRule`` for ``torch.optim.Muon``, else a ``TorchClassRule`` with the class's
    defaults (the
    class's own constructor checks ``given``: its ValueError or TypeError)."""
    check_elementwise(cls, elementwise)
    if is_muon(cls):
        try:  # torch's checks of the hyperparameters, on a matrix (Muon takes no other)
            probe = cls([torch.nn.Parameter(torch.zeros(1, 1))], **given)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{_name(cls)}: {exc}") from None
        return MuonRule(cls, probe.defaults, given)
    # The fused kernels implement AdamW without AMSGrad and minimizing; torch's own step
    # runs the other variants.
    if cls is torch.optim.AdamW and not given.get("amsgrad") and not given.get("maximize"):
        return ADAMW
    try:
        probe = cls([torch.nn.Parameter(torch.zeros(1))], **given)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{_name(cls)}: {exc}") from None
    return TorchClassRule(cls, probe.defaults, given)
