"""add_param_group of ZeroAdamW after construction: the new group's parameters get sharded
state (the layout is re-planned with the group appended) and are trained from the next step,
as torch's AdamW trains them. A mixin of ZeroAdamW."""

from __future__ import annotations

from typing import Any

import torch

from . import interop
from .interchange import strip_adamw_flags
from .registry import runtime_of_param
from .validate import (
    check_hparams,
    check_no_duplicates,
    check_same_on_all_ranks,
    common_dtype_device,
)


class ParamGroupsMixin:
    """Needs the optimizer's _params, _shapes, _index, _group_sizes, _steps, _frozen, _hooks,
    _engine, _rt, layout, comm, stage, _bucket_numel, _zero_kept, _on_grad, _build() and
    _broadcast_params()."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's: the new group's parameters are trained from the next step() on.

        After construction this re-plans the layout with the new group appended (the
        existing groups keep their place, so their state is copied over unchanged) and is a
        collective: call it on every rank with the same group. Not between a backward and its
        step() (the pending gradients would be lost): that is refused."""
        # torch.optim.AdamW's own flags (a group written for it, e.g. {"fused": True}):
        # checked, and not kept, before anything changes.
        if isinstance(param_group, dict):
            param_group = strip_adamw_flags(
                param_group, f" (param group {len(self.param_groups)})", self.defaults)
        if not getattr(self, "_constructed", False):
            super().add_param_group(param_group)  # the constructor's groups
            return
        if self._engine is not None and self._rt is None and \
                any(self._engine.reducer.got_grad):
            raise RuntimeError("add_param_group between backward() and step(): the pending "
                               "gradients would be lost; call it after step()")
        n_groups = len(self.param_groups)
        super().add_param_group(param_group)
        try:
            self._adopt_group(self.param_groups[-1])
        except BaseException:
            del self.param_groups[n_groups:]  # refused: nothing changed
            raise

    def _adopt_group(self, group: dict[str, Any]) -> None:
        check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                      f" (param group {len(self.param_groups) - 1})")
        check_no_duplicates(group["params"], len(self.param_groups) - 1)
        new = [p for p in group["params"] if p.requires_grad]
        owners = {id(rt) for rt in map(runtime_of_param, new)}
        if new and owners != {id(self._rt)}:
            raise ValueError("add_param_group: the new parameters must belong to the same "
                             + ("shard_model'ed model (stage 3)" if self._rt is not None
                                else "kind of model (not partitioned by shard_model)"))
        if new:
            common_dtype_device(self._params + new)
        shapes = [self._rt.shape_of(p) if self._rt else p.shape for p in new]
        check_same_on_all_ranks(self.comm, self.stage, self._bucket_numel,
                                [len(g) for g in self._group_sizes] + [len(new)],
                                self._shapes + shapes, self._params + new)
        first = len(self._params)
        if self._rt is None and new:
            self._broadcast_params(new)
        self._params += new
        self._shapes += shapes
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._group_sizes.append([sh.numel() for sh in shapes])
        self._steps += [0] * len(new)
        self._frozen += [p for p in group["params"] if not p.requires_grad]
        interop.register_params(new, self)
        self._watch_grads(new)  # stages 0-2: gradient hooks too
        if self._rt is not None:
            self._rt.hook_params(new)
        old = self._engine
        if old is None:
            return  # laid out at the first step, with the new group in it
        order = list(self.layout.ready_order) + list(range(first, len(self._params)))
        self.layout, self._engine = None, None
        self._build(order)
        eng = self._engine
        with torch.no_grad():
            # The existing groups keep their local space: a prefix of the new one (stage 3:
            # the same space).
            n = old.layout.local_numel
            for key in ("exp_avg", "exp_avg_sq", "master"):
                src = getattr(old, key)
                if src is not None:
                    getattr(eng, key).narrow(0, 0, n).copy_(src)
        if self._zero_kept:
            eng.zero_grad(set_to_none=False)
