"""A torch optimizer class as an update rule: the class's own ``step()`` run over one flat fp32
range of this rank's shard at a time (``TorchClassRule``).

For each range the rule hands an instance of the class (built once, over a placeholder) a
single parameter: the range's fp32 values, with the averaged gradient as its ``.grad`` and the
range's buffers as its state, and calls the class's step without its hooks (a step hook of
the script's must see the script's steps, not one per range). Whatever the class computes
element by element is then what DDP + the same class computes, to the rounding of the same
operations; ranges of several parameters are one call because the rule is element-wise
(``elementwise.py`` decides which classes are).

What the state holds is learnt from the class itself, by a probe: the class built with a
group's hyperparameters over a 3-element parameter and stepped once. Its state entries the
size of the parameter are per-element buffers (``state_names``, stored flat like AdamW's
moments), ``"step"`` is the step count zerokern keeps per parameter, and the rest are
per-parameter scalars (NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``): kept per parameter
by the optimizer (zero/rule_state.py) and advanced once per parameter and step by the same
class over an empty parameter (``advance``), so a parameter split over several ranges or
ranks never advances them twice. A state the class fills at construction (Adagrad's ``sum``
and step 0) is the ``init`` a parameter's first step starts from; a class that fills it in
its first step (all others) gets an empty state there, as torch's own first step does.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..state_format import StateFormat
from .base import TorchRule

SCALARS = "__zerokern_scalars__"
"""The key of a run's group copy holding its parameters' scalars (rule_state.py sets it)."""

_PROBE_VALUES = (0.5, -1.0, 2.0)
_PROBE_GRAD = (0.25, -0.5, 1.0)


@dataclass(frozen=True)
class Probe:
    """What the class keeps for a parameter under one group's hyperparameters."""

    buffers: tuple[str, ...]  # per-element state, in the class's order
    scalars: tuple[str, ...]  # per-parameter scalars besides the step
    has_step: bool  # a "step" entry in the class's state
    init: dict[str, Any]  # the state right after construction ({}: filled at the first step)


def raw_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` without the step hooks torch wraps around it (global and the
    instance's): the rule's calls are not the script's steps."""
    fn = type(opt).step
    fn = getattr(fn, "__wrapped__", fn) if getattr(fn, "hooked", False) else fn
    fn(opt)


class TorchClassRule(TorchRule):
    """The update of torch optimizer class ``cls`` (element-wise: ``elementwise.py``) over
    flat fp32 ranges; ``defaults``: the class's defaults with the user's values, ``given``:
    the user's keywords."""

    probe_shape: tuple[int, ...] = (3,)
    """The shape of the probe's parameter (Muon's: a matrix, as it takes nothing else)."""

    # torch's buffers that are sums or averages of squares (or of absolute values): a loaded
    # negative value is a corrupt state (base.UpdateRule.check_state).
    nonnegative = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "exp_inf",
                   "acc_delta")

    def __init__(self, cls: type[torch.optim.Optimizer], defaults: Mapping[str, Any],
                 given: Mapping[str, Any] | None = None) -> None:
        self.torch_class = cls  # type: ignore[misc]
        self.given = dict(given or {})  # the hyperparameters the caller gave the class
        self.name = f"torch:{cls.__module__}.{cls.__qualname__}"  # type: ignore[misc]
        self.defaults = dict(defaults)  # type: ignore[misc]
        self.state_names: tuple[str, ...] = ()  # type: ignore[misc]  # declare() sets them
        self.scalar_names: tuple[str, ...] = ()
        self.has_step = True
        self._probes: dict[str, Probe] = {}
        self._runner: torch.optim.Optimizer | None = None
        self._empty: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    @property
    def label(self) -> str:
        """The class as errors name it."""
        return class_name(self.torch_class)

    @property
    def torch_keys(self) -> tuple[str, ...]:
        return (("step",) if self.has_step else ()) + self.state_names + self.scalar_names

    # -- what the class keeps ------------------------------------------------------------------
    def hparams(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The group's values of the class's hyperparameters (other keys, such as a
        scheduler's ``initial_lr``, are not the class's)."""
        return {k: group[k] for k in self.defaults if k in group}

    def probe(self, group: Mapping[str, Any], where: str = "") -> Probe:
        """The class built with ``group``'s hyperparameters (torch's own checks: its
        ValueError, with ``where`` added) and stepped once over a 3-element parameter."""
        hp = self.hparams(group)
        key = repr(sorted(hp.items(), key=lambda kv: kv[0]))
        got = self._probes.get(key)
        if got is not None:
            return got
        if hp.get("differentiable", False):
            raise ValueError(f"differentiable=True{where}: {self.label}'s step is run inside "
                             "zerokern's step and not recorded by autograd; use "
                             "differentiable=False")
        p = torch.nn.Parameter(torch.tensor(_PROBE_VALUES).reshape(self.probe_shape))
        try:
            opt = self._build(p, hp)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{self.label}{where}: {exc}") from None
        init = {k: _clone(v) for k, v in opt.state.get(p, {}).items()}
        p.grad = torch.tensor(_PROBE_GRAD).reshape(self.probe_shape)
        with torch.no_grad():
            raw_step(opt)
        st = opt.state.get(p, {})
        buffers = tuple(k for k, v in st.items() if torch.is_tensor(v) and v.shape == p.shape)
        scalars = tuple(k for k, v in st.items() if k != "step" and k not in buffers)
        for k in scalars:
            v = st[k]
            if not (torch.is_tensor(v) and v.numel() == 1) and not isinstance(v, (int, float)):
                raise ValueError(f"{self.label}: its state {k!r} is neither one value per "
                                 "element nor one number per parameter: not element-wise")
        for k in buffers:
            t = init.get(k)
            if t is not None and not bool((t == t.reshape(-1)[0]).all()):
                raise ValueError(f"{self.label}: its initial {k!r} differs between elements: "
                                 "not element-wise")
        got = self._probes[key] = Probe(buffers, scalars, "step" in st, init)
        return got

    def declare(self, groups: list[Mapping[str, Any]]) -> None:
        """Fix the buffers and scalars the state holds from the groups at construction (every
        group's, in the class's order); ValueError as ``probe``."""
        bufs: dict[str, None] = {}
        scal: dict[str, None] = {}
        has_step = False
        for gi, g in enumerate(groups):
            pr = self.probe(g, f" (param group {gi})")
            bufs.update(dict.fromkeys(pr.buffers))
            scal.update(dict.fromkeys(pr.scalars))
            has_step = has_step or pr.has_step
        self.state_names, self.scalar_names = tuple(bufs), tuple(scal)  # type: ignore[misc]
        self.has_step = has_step or not groups

    def check_hparams(self, group: Mapping[str, Any], where: str = "",
                      fmt: StateFormat | None = None) -> None:
        pr = self.probe(group, where)
        extra = [k for k in (*pr.buffers, *pr.scalars)
                 if k not in self.state_names and k not in self.scalar_names]
        if extra:
            raise ValueError(
                f"{self.label}{where}: these hyperparameters need the state {extra}, which "
                "the optimizer did not keep at construction (the flat buffers are laid out "
                "then); give the group such values from the start (e.g. momentum > 0)")
        if fmt is not None:
            self.check_format(fmt)

    def check_format(self, fmt: StateFormat) -> None:
        if fmt.moments != "fp32":
            raise ValueError(f"moments={fmt.moments!r}: compressed state is implemented for "
                             f"torch.optim.AdamW only, not {self.label}; use moments='fp32'")
        if fmt.master != "fp32":
            raise ValueError(f"master={fmt.master!r}: stepping 16-bit parameters in place is "
                             f"implemented for torch.optim.AdamW only, not {self.label}; use "
                             "master='fp32'")

    # -- the update ----------------------------------------------------------------------------
    def _instance(self) -> torch.optim.Optimizer:
        if self._runner is None:
            self._runner = self._build(torch.nn.Parameter(torch.zeros(1)), self.defaults)
        return self._runner

    def _build(self, p: torch.nn.Parameter, hp: Mapping[str, Any]) -> torch.optim.Optimizer:
        """The class over ``[p]`` with the group values ``hp``: constructed with them (its
        own checks), or, where its constructor does not take them all as keywords (a
        subclass fixing some), as the caller constructed it and given them in its group."""
        try:
            return construct(self.torch_class, p, hp)
        except TypeError:
            opt = construct(self.torch_class, p, self.given)
            opt.param_groups[0].update(hp)
            return opt

    def _start_state(self, pr: Probe, group: Mapping[str, Any], step: int,
                     device: torch.device) -> dict[str, Any]:
        """The class's state of a parameter before step ``step`` (1-based), buffers aside."""
        if step == 1:  # the parameter's first step: as the class starts it
            return {k: _clone(v) for k, v in pr.init.items() if k not in pr.buffers}
        dev = device if group.get("capturable") or group.get("fused") else None
        scalars = group.get(SCALARS) or {}
        out: dict[str, Any] = {}
        if pr.has_step:
            out["step"] = torch.tensor(float(step - 1), dtype=_scalar_dtype(pr), device=dev)
        for k in pr.scalars:
            v = scalars[k]
            out[k] = v.clone().to(dev) if torch.is_tensor(v) else v
        return out

    def _run(self, values: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
             group: Mapping[str, Any]) -> dict[str, Any]:
        opt = self._instance()
        g = opt.param_groups[0]
        g.update(self.hparams(group))
        g["params"] = [values]
        opt.state.clear()
        if state:
            opt.state[values].update(state)
        values.grad = grad
        try:
            raw_step(opt)
            return dict(opt.state.get(values, {}))
        finally:
            values.grad = None
            opt.state.clear()
            g["params"] = []

    def update(self, values: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
               group: Mapping[str, Any], step: int) -> None:
        pr = self.probe(group)
        st = self._start_state(pr, group, step, values.device)
        for k in pr.buffers:
            if step > 1 or k in pr.init:
                if step == 1:
                    state[k].copy_(pr.init[k].reshape(-1)[0])
                st[k] = state[k]
        out = self._run(values, grad, st, group)
        for k in pr.buffers:
            t = out.get(k)
            if t is not None and t is not state[k]:
                state[k].copy_(t)

    def advance(self, group: Mapping[str, Any], step: int,
                device: torch.device) -> dict[str, Any]:
        """A parameter's scalars after its step ``step`` (1-based), its scalars before being
        ``group[SCALARS]``: the class's step over an empty parameter of that state."""
        pr = self.probe(group)
        if not pr.scalars:
            return {}
        key = (device, torch.float32)
        empty = self._empty.get(key)
        if empty is None:
            empty = self._empty[key] = torch.zeros(0, device=device)
        st = self._start_state(pr, group, step, device)
        for k in pr.buffers:
            if step > 1 or k in pr.init:
                st[k] = torch.zeros(0, device=device)
        out = self._run(empty, torch.zeros(0, device=device), st, group)
        return {k: _clone(out[k]) for k in pr.scalars}

    def initial_scalars(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """A fresh parameter's scalars (those before its first step is taken)."""
        pr = self.probe(group)
        return {k: _clone(pr.init[k]) if k in pr.init else None for k in pr.scalars}

    def __repr__(self) -> str:
        return f"TorchClassRule({self.label})"


def construct(cls: type[torch.optim.Optimizer], p: torch.nn.Parameter,
              hp: Mapping[str, Any]) -> torch.optim.Optimizer:
    """``cls([p], **hp)`` with the keys its constructor takes, the others (a group key the
    class puts there itself, e.g. AdamW's ``decoupled_weight_decay``) set in its group."""
    try:
        sig = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        sig = None
    if sig is None or any(q.kind is inspect.Parameter.VAR_KEYWORD for q in sig.values()):
        takes = dict(hp)
    else:
        takes = {k: v for k, v in hp.items() if k in sig}
    opt = cls([p], **takes)
    opt.param_groups[0].update({k: v for k, v in hp.items() if k not in takes})
    return opt


def class_name(cls: type) -> str:
    """``torch.optim.SGD`` (not ``torch.optim.sgd.SGD``), ``mymodule.MyOptimizer``."""
    mod = cls.__module__
    return f"{'torch.optim' if mod.startswith('torch.optim') else mod}.{cls.__qualname__}"


def _clone(v: Any) -> Any:
    return v.detach().clone() if torch.is_tensor(v) else v


def _scalar_dtype(pr: Probe) -> torch.dtype:
    t = pr.init.get("step")
    if torch.is_tensor(t):
        return t.dtype
    # What torch's optimizers hold their step counts in (float32 unless the default is
    # float64).
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
