"""The state-facing half of ZeroAdamW: the public sharded-state interface (shards,
edit_shards) and the per-rank state dict. A mixin, so that optimizer.py keeps the step's
sequence and this file what is read and written of the state."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .interchange import is_torch_format
from .shards import ParamShard, ShardedStateView, ShardRange


class ShardedStateMixin:
    """Needs the optimizer's _params, _shapes, _steps, _index, _engine, _rt, layout, comm,
    stage, scaler, param_groups and _build()."""

    # -- opt.state --------------------------------------------------------------------------
    @property
    def state(self) -> Any:
        """This rank's part of each parameter's state, in torch's keys (ShardedStateView)."""
        # getattr, not __dict__: Lightning's wrapper forwards the attribute to the optimizer.
        view = getattr(self, "_state_view", None)
        return {} if view is None else view

    @state.setter
    def state(self, value: Any) -> None:
        if isinstance(value, ShardedStateView):
            self.__dict__["_state_view"] = value
            return
        view = getattr(self, "_state_view", None)
        if view is None:  # torch.optim.Optimizer.__init__'s empty dict: no state exists yet
            return
        view.replace(value)  # opt.state = defaultdict(dict): a reset, as in torch

    # -- sharded state ----------------------------------------------------------------------
    @property
    def managed_params(self) -> tuple[torch.nn.Parameter, ...]:
        """The parameters this optimizer trains (requires_grad at construction), in
        param-group order: the indices of shards() and of the state dicts."""
        return tuple(self._params)

    def shards_step(self, index: int) -> int:
        """The step count of managed parameter ``index`` (torch: ``state[p]["step"]``)."""
        return self._steps[index]

    def full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        """The full shape of a managed parameter (stage 3: not its released empty shape)."""
        return self._shapes[self._index[id(p)]]

    def shards(self, model: torch.nn.Module | None = None, *,
               ready_order: list[int] | None = None) -> list[ParamShard]:
        """Per managed parameter: its full shape, step count, and the element ranges this rank
        holds with writable fp32 views of their values, exp_avg and exp_avg_sq.

        Names come from ``model`` (its ``named_parameters``) when given, else from named
        param groups (``ZeroAdamW(model.named_parameters())``) or the shard_model'ed model.
        Before the first step() of stages 0-2 this fixes the bucket layout (in
        ``ready_order``, indices of managed_params, default reverse registration order),
        as loading a state does."""
        L = self._build(ready_order)
        self._adopt_param_writes()  # weights written into the model since: they are the values
        names = self._names(model)
        group_of = {id(p): g for g, grp in enumerate(self.param_groups) for p in grp["params"]}
        ranges: list[list[ShardRange]] = [[] for _ in self._params]
        eng = self._engine
        for pc in L.pieces:
            if pc.param < 0:
                continue
            s, n = pc.local_start, pc.numel
            ranges[pc.param].append(ShardRange(
                pc.param_offset, n, eng.values(s, n), eng.exp_avg.narrow(0, s, n),
                eng.exp_avg_sq.narrow(0, s, n)))
        return [ParamShard(i, names.get(id(p)), p, group_of[id(p)], self._shapes[i], p.dtype,
                           self._steps[i], tuple(sorted(ranges[i], key=lambda r: r.start)))
                for i, p in enumerate(self._params)]

    @contextmanager
    def edit_shards(self, model: torch.nn.Module | None = None, *, gather: bool = True,
                    ready_order: list[int] | None = None) -> Iterator[list[ParamShard]]:
        """Write this rank's optimizer state: yields shards(); write into their views and
        assign their ``step``. On leaving, the steps are taken and the parameters take the
        new values (16-bit: rounded to nearest even). Call on every rank: with ``gather``
        (stages 1-2) the new parameters are all-gathered, a collective; ``gather=False``
        means the caller writes every rank's full parameters itself. If the block raises,
        the steps and parameters are left as they were (the views may be written)."""
        shards = self.shards(model, ready_order=ready_order)
        yield shards
        for sh in shards:
            if isinstance(sh.step, bool) or not isinstance(sh.step, int) or sh.step < 0:
                raise ValueError(f"step of parameter {sh.index} ({sh.name}) must be an int "
                                 f">= 0, got {sh.step!r}")
        with torch.no_grad():
            self._engine.sync_params(gather)
        self._mark_params()
        for sh in shards:
            self._steps[sh.index] = sh.step
        self.state.refresh_steps()

    def _names(self, model: torch.nn.Module | None) -> dict[int, str]:
        if model is not None:
            return {id(p): n for n, p in model.named_parameters()}
        out: dict[int, str] = {}
        for g in self.param_groups:
            for p, n in zip(g["params"], g.get("param_names") or []):
                out[id(p)] = n
        if not out and self._rt is not None:
            out = dict(self._rt.param_names)
        return out

    # -- checkpointing ----------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        L = self.layout
        return {"stage": self.stage, "world_size": self.comm.world_size,
                "rank": self.comm.rank, "local_numel": None if L is None else L.local_numel,
                "flat_numel": None if L is None else L.flat_numel,
                "ready_order": None if L is None else list(L.ready_order),
                "shapes": [list(sh) for sh in self._shapes]}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (flat buffers in its local layout). Before
        the first step() nothing has been laid out or trained: as torch's AdamW, the state is
        empty ({}), and asking fixes nothing."""
        groups = []
        idx = 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(idx, idx + n))})
            idx += n
        self._adopt_param_writes()
        eng = self._engine
        state: dict[str, Any] = {} if eng is None else {
            "exp_avg": eng.exp_avg.clone(), "exp_avg_sq": eng.exp_avg_sq.clone(),
            "master": None if eng.master is None else eng.master.clone(),
            "steps": torch.tensor(self._steps, dtype=torch.int64),
        }
        return {
            "state": state, "param_groups": groups,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "zerokern": self._meta(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's own ``state_dict()``, or a full torch.optim.AdamW-format state dict
        (every rank passes the same one: from full_state_dict, any world size or stage, or a
        single-process AdamW run; 16-bit parameters then take their fp32 master from the
        current parameters)."""
        if is_torch_format(state_dict):
            self._load_torch_format(state_dict)
            return
        meta = state_dict.get("zerokern")
        if meta is None:
            raise ValueError("state_dict: neither a ZeroAdamW state dict (no 'zerokern' "
                             "entry) nor a torch.optim.AdamW one ('state' and "
                             "'param_groups')")
        st = state_dict["state"]
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError("state_dict: number of param groups differs")
        shapes = meta.get("shapes")  # absent in state dicts of zerokern before 2026-12
        if shapes is not None and shapes != self._meta()["shapes"]:
            mine = self._meta()["shapes"]
            if len(shapes) != len(mine):
                raise ValueError(f"state_dict holds {len(shapes)} trainable parameters, this "
                                 f"optimizer has {len(mine)}: it comes from another model")
            i = next(k for k, (a, b) in enumerate(zip(shapes, mine)) if a != b)
            raise ValueError(f"state_dict: parameter {i} has shape {shapes[i]} there and "
                             f"{mine[i]} here: it comes from another model")
        mine = self._meta()
        if any(meta[k] != mine[k] for k in ("stage", "world_size", "rank")):
            raise ValueError(
                f"state_dict holds only rank {meta['rank']}'s shard of a stage-{meta['stage']} "
                f"ZeroAdamW over {meta['world_size']} ranks; this optimizer is rank "
                f"{mine['rank']} of {mine['world_size']} at stage {mine['stage']}. A per-rank "
                "state dict loads only on the rank (world size and stage) that saved it: save "
                "opt.state_dict() on every rank, or use opt.full_state_dict() (torch AdamW "
                "format, loadable anywhere) or zerokern.save_checkpoint")
        if st:
            self._build(list(meta.get("ready_order") or []) or None)
            mine = self._meta()
            for k in ("local_numel", "flat_numel", "ready_order"):
                if meta[k] != mine[k]:
                    raise ValueError(
                        f"state_dict was saved with {k}={meta[k]}, this optimizer has {k}="
                        f"{mine[k]}; use zerokern.load_checkpoint to change world size or "
                        "stage")
        eng = self._engine
        with torch.no_grad():
            if st:
                eng.exp_avg.copy_(st["exp_avg"])
                eng.exp_avg_sq.copy_(st["exp_avg_sq"])
                if eng.master is not None and st.get("master") is not None:
                    eng.master.copy_(st["master"])
                elif eng.master is not None:
                    # Saved without offload from fp32 parameters (their own master): an
                    # offloading optimizer's host copy is the parameters themselves.
                    eng.init_master()
                self._steps = [int(x) for x in st["steps"].tolist()]
            elif eng is not None:  # a state saved before any step: a fresh state
                eng.exp_avg.zero_()
                eng.exp_avg_sq.zero_()
                eng.init_master()
                self._steps = [0] * len(self._params)
        for g, sg in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        if self.scaler is not None and state_dict.get("scaler") is not None:
            self.scaler.load_state_dict(state_dict["scaler"])
        self._mark_params()  # the loaded master is the one to train from
        self.state.refresh_steps()
