"""One optimizer over parameters of several dtypes (stages 0-3): ``MixedParts``.

``ZeroAdamW`` / ``ZeroOptimizer`` given trained parameters of several dtypes (a bf16
embedding and fp32 matrices), or param groups with their own ``master``, build one part per
(dtype, master) partition (mixed_plan.py): each a whole optimizer of the same class over its
sub-groups, with its own flat buffers, buckets and state. The optimizer the script holds
becomes a ``MixedParts`` of its class (core.py switches its class once the parts exist) and
spans them: ``step`` (one global norm for ``max_grad_norm``), ``zero_grad``, ``no_sync``,
``clip_grad_norm_`` (one norm over every part, joint_clip.py), ``state`` and ``shards()``
keyed by the parameter as one optimizer, the torch-format state dict keyed by parameter index
across all groups, per-rank state dicts, ``memory_stats`` / ``comm_stats`` summed over the
parts, and ``save_checkpoint`` / ``load_checkpoint`` (read through ``shards()`` and
``edit_shards()`` in the global order). A single-dtype optimizer is never one of these.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from . import interop
from .joint_clip import clip_joint
from .mixed_plan import NOT_PUSHED, Part
from .mixed_state import MixedState
from .state_format import StateFormat


@dataclasses.dataclass
class _Layout:
    """What the checkpoint reads of ``opt.layout``: the gradient order, global indices."""

    ready_order: list[int]


class _StateUnion(Mapping):
    """``opt.state``: each part's ``ShardedStateView``, looked up by parameter."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def __getitem__(self, p: Any) -> Any:
        for part in self.parts:
            if p in part.state:
                return part.state[p]
        raise KeyError(p)

    def __iter__(self) -> Iterator[Any]:
        for part in self.parts:
            yield from part.state

    def __len__(self) -> int:
        return sum(len(part.state) for part in self.parts)


def _sum(a: Any, b: Any) -> Any:
    """Two statistics dicts added leaf by leaf (a key only one has is kept)."""
    if isinstance(a, dict):
        return {k: _sum(a.get(k), b.get(k)) if k in a and k in b else a.get(k, b.get(k))
                for k in {**a, **b}}
    return a + b


class MixedParts(MixedState):
    """The methods of an optimizer split into dtype parts (first in its class's MRO)."""

    _parts: list[Any]
    _plan: list[Part]
    param_groups: list[dict[str, Any]]

    def _init_parts(self, parts: list[Any], plan: list[Part], cfg: Any) -> None:
        self._parts, self._plan = parts, plan
        first = parts[0]
        self.config, self.stage, self.offload = cfg, cfg.stage, cfg.offload
        self.max_grad_norm = None if cfg.max_grad_norm is None else float(cfg.max_grad_norm)
        self.scaler = None  # refused with several parts (mixed_plan.py)
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self.comm, self.rule, self._rt = first.comm, first.rule, None
        self._agreed = first._agreed
        n = sum(len(pl.managed) for pl in plan)
        self._where: list[tuple[int, int]] = [(0, 0)] * n  # global -> (part, local)
        for k, pl in enumerate(plan):
            for i, g in enumerate(pl.managed):
                self._where[g] = (k, i)
        # Torch's numbering: every parameter of every user group, frozen ones included.
        self._torch_index: list[int] = []
        t = 0
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    self._torch_index.append(t)
                t += 1
        self._constructed = True
        # torch.nn.utils.clip_grad_norm_ of these parameters: one norm over every part.
        interop.register_params(list(self.managed_params), self)

    # -- the user's groups and the parts' sub-groups ----------------------------------------
    def _subgroups(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        for pl, part in zip(self._plan, self._parts):
            for j, gi in enumerate(pl.source):
                yield self.param_groups[gi], part.param_groups[j]

    def _push(self) -> None:
        """The user's groups' hyperparameters (a scheduler's lr, a script's edit) into the
        parts' sub-groups."""
        for g, sub in self._subgroups():
            for k, v in g.items():
                if k not in NOT_PUSHED:
                    sub[k] = v

    # -- what a single optimizer holds, over the parts --------------------------------------
    @property
    def managed_params(self) -> tuple[torch.nn.Parameter, ...]:
        """The trained parameters in param-group order (every part's, as one optimizer)."""
        return tuple(self._parts[k].managed_params[i] for k, i in self._where)

    def shards_step(self, index: int) -> int:
        k, i = self._where[index]
        return self._parts[k].shards_step(i)

    @property
    def layout(self) -> _Layout | None:
        """The gradient order of every part (global indices), or None before the first
        step() laid them out."""
        if any(part.layout is None for part in self._parts):
            return None
        return _Layout([pl.managed[i] for pl, part in zip(self._plan, self._parts)
                        for i in part.layout.ready_order])

    @property
    def state_format(self) -> Any:
        """The parts' common state format. Parts that differ only in ``master`` with fp32
        moments (bf16 stepped in place beside fp32 state) give the default format: what
        save_checkpoint writes for them (fp32 values and moments, exact for bf16 values; the
        stochastic rounding's seed is then the optimizer's, not the checkpoint's). Other
        differences are refused: a checkpoint holds one format."""
        fmts = {part.state_format for part in self._parts}
        if len(fmts) == 1:
            return fmts.pop()
        if all(f.moments == "fp32" for f in fmts):
            return StateFormat()
        raise ValueError(
            "the parts of this optimizer store their state in different formats ("
            + ", ".join(f"{pl.dtype}: master={pl.master!r}" for pl in self._plan)
            + ") with compressed moments; save_checkpoint holds one format: use "
            "state_dict() / full_state_dict() for this optimizer")

    @property
    def seed(self) -> int:
        return self._parts[0].seed

    @seed.setter
    def seed(self, value: int) -> None:
        for part in self._parts:
            part.seed = value

    @property
    def dtype(self) -> torch.dtype:
        """The first part's dtype (the parts hold several; ``dtypes`` lists them)."""
        return self._parts[0].dtype

    @property
    def dtypes(self) -> list[torch.dtype]:
        """Each part's parameter dtype."""
        return [part.dtype for part in self._parts]

    @property
    def device(self) -> torch.device:
        return self._parts[0].device

    @property
    def backend(self) -> str | None:
        return self._parts[0].backend

    @property
    def _engine(self) -> None:
        return None

    @property
    def state(self) -> Any:
        return _StateUnion(self._parts) if hasattr(self, "_parts") else {}

    @state.setter
    def state(self, value: Any) -> None:
        for part in getattr(self, "_parts", []):
            part.state = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_constructed", False):
            super().add_param_group(param_group)  # type: ignore[misc]
            return
        raise NotImplementedError(
            "add_param_group: not supported yet on an optimizer whose parameters have "
            "several dtypes (or groups with their own 'master'); list every group at "
            "construction")

    # -- the training loop ------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with ExitStack() as stack:
            for part in self._parts:
                stack.enter_context(part.no_sync())
            yield

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss  # no loss scaler with several parts (mixed_plan.py)

    @property
    def loss_scale(self) -> float:
        return 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self._parts:
            part.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Every part's step; ``max_grad_norm`` clips by the norm over all of them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._push()
        if self.max_grad_norm is not None:
            clip_joint(self._parts, self.max_grad_norm)
        for part in self._parts:
            part.step()
        norms = [part.last_grad_norm for part in self._parts]
        if all(n is not None for n in norms):
            self.last_grad_norm = math.sqrt(math.fsum(n * n for n in norms))
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every part: one global norm (a collective)."""
        self._push()
        return clip_joint(self._parts, max_norm, norm_type,
                          error_if_nonfinite=error_if_nonfinite)

    # -- introspection ----------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        """Every part's bytes, summed by kind."""
        out: dict[str, int] = {}
        for part in self._parts:
            out = _sum(out, part.memory_stats())
        return out

    def comm_stats(self) -> dict[str, Any]:
        """Every part's collectives of the last step, summed (elements, bytes, per kind,
        per mesh dim; ``numel`` is the trained elements of all of them)."""
        out: dict[str, Any] = {}
        for part in self._parts:
            out = _sum(out, part.comm_stats())
        return out


_CLASSES: dict[type, type] = {}


def mixed_class(cls: type) -> type:
    """``cls`` (ZeroAdamW, ZeroOptimizer or a subclass) spanning dtype parts."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (MixedParts, cls),
                             {"__module__": cls.__module__, "__doc__": cls.__doc__,
                              "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def build_parts(opt: Any, plan: list[Part], resolve: Any, cfg: Any, *, mesh: Any,
                process_group: Any, optimizer: str) -> None:
    """Build one optimizer of ``opt``'s class per part (each agrees across ranks as any
    optimizer does), then make ``opt`` the one that spans them."""
    cls = type(opt)
    parts = []
    for pl in plan:
        sub = cls.__new__(cls)
        sub._construct(pl.groups, resolve, {},
                       dataclasses.replace(cfg, master=pl.master, max_grad_norm=None),
                       mesh=mesh, process_group=process_group, optimizer=optimizer)
        parts.append(sub)
    opt.__class__ = mixed_class(cls)
    opt._init_parts(parts, plan, cfg)
