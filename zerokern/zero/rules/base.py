"""The update-rule part (issue 36): what an optimizer's element-wise update needs from the
sharded state, and nothing about where the state is or how it is stored.

A rule names its per-element state buffers (``state_names``, the keys of torch's per-parameter
state), says which int8 code map each is quantized on, checks its hyperparameters, and steps a
flat range: the values (fp32 master, or the parameters themselves), their gradient, and its
buffers as ``Stored`` views (zero/stored.py). The stage chooses the ranges, the placement runs
the step where the state lives, the stored type reads and writes each buffer's format; so a
new rule is one class here, registered by name, touching no stage, placement or checkpoint
code.

``TorchRule`` is the generic form: it runs an update written against fp32 tensors (a torch
optimizer's functional update over the flat views) and stores the buffers back in their
format. ``AdamWRule`` (adamw.py) is the first rule; it launches the fused kernels instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...quant.adamw import DEFAULT_INT8_FORMAT
from ...quant.maps import SIGNED_MAP_ID, versioned_map_id
from ..state_format import StateFormat
from ..stored import Fp32Stored, Stored


@dataclass(frozen=True)
class RangeStep:
    """One step of one flat range, as a rule receives it.

    ``values``: updated in place (the fp32 master, or without one the parameters themselves);
    ``grad``: the averaged gradient, divided by ``grad_scale`` in the update; ``state``: the
    rule's buffers for the range, as stored; ``group``: its param group; ``step``: the 1-based
    step count; ``backend``: the kernels' backend of the placement. ``in_runs``: the range is
    one run of a non-default state format (one stored format, ``sr_index`` and ``seed`` keying
    the stochastic rounding of bf16 ``values``); False for the default fp32 state."""

    values: torch.Tensor
    grad: torch.Tensor
    state: Mapping[str, Stored]
    group: Mapping[str, Any]
    step: int
    grad_scale: float
    backend: str | None
    in_runs: bool = False
    sr_index: torch.Tensor | None = None
    seed: int = 0


class UpdateRule(ABC):
    """An element-wise optimizer update over this rank's flat shard."""

    name: ClassVar[str]
    state_names: ClassVar[tuple[str, ...]]
    """Its per-element buffers, as torch's per-parameter state names them, in order."""
    defaults: ClassVar[dict[str, Any]]
    """Its hyperparameters' default values (the keys of a param group it reads)."""
    code_maps: ClassVar[dict[str, str]] = {}
    """The int8 code map of each buffer (default: the signed map), as format version 2 names
    it; ``map_id`` gives the same map in another version."""
    torch_class: ClassVar[type[torch.optim.Optimizer]]
    """torch's optimizer of the same update: its state dicts are the interchange format."""

    nonnegative: ClassVar[tuple[str, ...]] = ()
    """The buffers that are never negative (a second moment): a loaded negative is refused."""

    def check_state(self, name: str, t: Any, where: str) -> None:
        """A loaded buffer ``name`` (torch's format): a floating-point tensor of finite
        values (and not negative where ``nonnegative`` says so). A NaN or a negative second
        moment would make every later update of the parameter NaN."""
        if not torch.is_tensor(t) or not t.dtype.is_floating_point:
            raise ValueError(f"{where} must be a floating-point tensor, got "
                             f"{t.dtype if torch.is_tensor(t) else type(t).__name__}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where} holds a NaN or an infinity: the state is corrupt "
                             "(a run that diverged?); load an earlier checkpoint")
        if name in self.nonnegative and bool((t < 0).any()):
            raise ValueError(f"{where} holds negative values ({float(t.min()):.3g}); it is "
                             "a sum of squares, never negative: the state is corrupt")

    def map_id(self, name: str, version: int = DEFAULT_INT8_FORMAT) -> str:
        """The id of buffer ``name``'s int8 code map in format ``version`` (2 or 3)."""
        return versioned_map_id(self.code_maps.get(name, SIGNED_MAP_ID), version)

    @property
    def torch_keys(self) -> tuple[str, ...]:
        """The keys of torch's per-parameter state: the step count and the buffers."""
        return ("step", *self.state_names)

    @abstractmethod
    def check_hparams(self, group: Mapping[str, Any], where: str = "",
                      fmt: StateFormat | None = None) -> None:
        """Refuse, naming it, a hyperparameter of ``group`` this rule cannot step with
        (``fmt``: the state format, for limits of a stored format); nothing changes."""

    def check_format(self, fmt: StateFormat) -> None:  # noqa: B027 - optional, default any
        """Refuse a state format this rule cannot step (default: any)."""

    @abstractmethod
    def step(self, r: RangeStep, lp: torch.Tensor | None) -> None:
        """Update ``r.values`` and ``r.state`` in place; write the new parameters, rounded to
        nearest even, into ``lp`` when given (16-bit parameters, written in the same pass)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchRule(UpdateRule):
    """A rule whose update is written against fp32 tensors (``update``): the buffers are read
    as fp32 (views where stored in fp32, decoded copies elsewhere, stored back after), the
    gradient divided by the grad scale. Values that are not fp32 are updated through an fp32
    copy rounded back to nearest even."""

    @abstractmethod
    def update(self, values: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
               group: Mapping[str, Any], step: int) -> None:
        """The update of fp32 ``values`` (in place) with fp32 ``grad``; ``state``: the fp32
        buffers, updated in place."""

    def step(self, r: RangeStep, lp: torch.Tensor | None) -> None:
        views = {k: (s.data if isinstance(s, Fp32Stored) else s.read())
                 for k, s in r.state.items()}
        grad = r.grad if r.grad.dtype == torch.float32 else r.grad.float()
        if r.grad_scale != 1.0:
            grad = grad / r.grad_scale
        values = r.values if r.values.dtype == torch.float32 else r.values.float()
        self.update(values, grad, views, r.group, r.step)
        for k, s in r.state.items():
            if views[k] is not s.data:
                s.write(views[k])
        if values is not r.values:
            r.values.copy_(values)
        if lp is not None:
            lp.copy_(values)


RULES: dict[str, UpdateRule] = {}


def register_rule(rule: UpdateRule) -> UpdateRule:
    """Make ``rule`` known by its name (checkpoints and state dicts name the rule)."""
    RULES[rule.name] = rule
    return rule


def get_rule(name: str) -> UpdateRule:
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown update rule {name!r} (known: {', '.join(RULES)})") from None
