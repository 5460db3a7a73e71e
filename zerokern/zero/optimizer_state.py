"""What is read and written of this rank's optimizer state from outside the step:
``opt.state`` (the ShardedStateView of shards.py), ``shards()`` / ``edit_shards()`` (the
public sharded-state interface that checkpoints and the torch-format interchange are written
against, never the engine's buffers) and the per-rank state dict (ZeroAdamW's own format:
this rank's flat buffers in its local layout).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..comm import Comm
from .engine_slot import EngineSlot
from .param_table import ParamTable
from .scaler import LossScaler
from .shards import ParamShard, ShardedStateView, ShardRange


class StateAccess:
    """The optimizer state as seen from outside: ``view`` is ``opt.state``; ``shards`` is
    ZeroAdamW.shards (the view lists its entries through it)."""

    def __init__(self, table: ParamTable, slot: EngineSlot, comm: Comm, *, stage: int,
                 runtime: Any, shards: Callable[[], list[ParamShard]]) -> None:
        self.table, self.slot, self.comm, self.stage, self.rt = table, slot, comm, stage, runtime
        self.view = ShardedStateView(table, slot, shards)

    def adopt_writes(self) -> None:
        """What was written from outside since the engine last wrote: step tensors of
        ``opt.state`` written in place, then the parameters' values (engine_slot.py)."""
        self.view.adopt_step_writes()
        self.slot.adopt_param_writes()

    # -- sharded state ----------------------------------------------------------------------
    def shards(self, param_groups: list[dict[str, Any]], model: torch.nn.Module | None = None,
               ready_order: list[int] | None = None) -> list[ParamShard]:
        """ZeroAdamW.shards(): fixes the layout if not yet done."""
        L = self.slot.build(param_groups, ready_order)
        self.adopt_writes()  # weights written into the model since: they are the values
        names = self._names(param_groups, model)
        group_of = {id(p): g for g, grp in enumerate(param_groups) for p in grp["params"]}
        ranges: list[list[ShardRange]] = [[] for _ in self.table.params]
        eng = self.slot.engine
        for pc in L.pieces:
            if pc.param < 0:
                continue
            s, n = pc.local_start, pc.numel
            ranges[pc.param].append(ShardRange(
                pc.param_offset, n, eng.values(s, n), eng.exp_avg.narrow(0, s, n),
                eng.exp_avg_sq.narrow(0, s, n)))
        t = self.table
        return [ParamShard(i, names.get(id(p)), p, group_of[id(p)], t.shapes[i], p.dtype,
                           t.steps[i], tuple(sorted(ranges[i], key=lambda r: r.start)))
                for i, p in enumerate(t.params)]

    @contextmanager
    def edit(self, param_groups: list[dict[str, Any]], model: torch.nn.Module | None = None,
             gather: bool = True, ready_order: list[int] | None = None,
             ) -> Iterator[list[ParamShard]]:
        """ZeroAdamW.edit_shards()."""
        shards = self.shards(param_groups, model, ready_order)
        yield shards
        for sh in shards:
            if isinstance(sh.step, bool) or not isinstance(sh.step, int) or sh.step < 0:
                raise ValueError(f"step of parameter {sh.index} ({sh.name}) must be an int "
                                 f">= 0, got {sh.step!r}")
        with torch.no_grad():
            self.slot.engine.sync_params(gather)
        self.slot.mark_params()
        for sh in shards:
            self.table.steps[sh.index] = sh.step
        self.view.refresh_steps()

    def _names(self, param_groups: list[dict[str, Any]],
               model: torch.nn.Module | None) -> dict[int, str]:
        if model is not None:
            return {id(p): n for n, p in model.named_parameters()}
        out: dict[int, str] = {}
        for g in param_groups:
            for p, n in zip(g["params"], g.get("param_names") or []):
                out[id(p)] = n
        if not out and self.rt is not None:
            out = dict(self.rt.param_names)
        return out

    # -- checkpointing ----------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        """What a per-rank state dict was saved for (it loads only there)."""
        L = self.slot.layout
        return {"stage": self.stage, "world_size": self.comm.world_size,
                "rank": self.comm.rank, "local_numel": None if L is None else L.local_numel,
                "flat_numel": None if L is None else L.flat_numel,
                "ready_order": None if L is None else list(L.ready_order),
                "shapes": [list(sh) for sh in self.table.shapes]}

    def state_dict(self, param_groups: list[dict[str, Any]],
                   scaler: LossScaler | None) -> dict[str, Any]:
        """ZeroAdamW.state_dict()."""
        groups = []
        idx = 0
        for g in param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(idx, idx + n))})
            idx += n
        self.adopt_writes()
        eng = self.slot.engine
        state: dict[str, Any] = {} if eng is None else {
            "exp_avg": eng.exp_avg.clone(), "exp_avg_sq": eng.exp_avg_sq.clone(),
            "master": None if eng.master is None else eng.master.clone(),
            "steps": torch.tensor(self.table.steps, dtype=torch.int64),
        }
        return {
            "state": state, "param_groups": groups,
            "scaler": None if scaler is None else scaler.state_dict(),
            "zerokern": self.meta(),
        }

    def load(self, state_dict: dict[str, Any], param_groups: list[dict[str, Any]],
             scaler: LossScaler | None) -> None:
        """ZeroAdamW.load_state_dict() of a per-rank state dict."""
        meta = state_dict.get("zerokern")
        if meta is None:
            raise ValueError("state_dict: neither a ZeroAdamW state dict (no 'zerokern' "
                             "entry) nor a torch.optim.AdamW one ('state' and "
                             "'param_groups')")
        st = state_dict["state"]
        if len(state_dict["param_groups"]) != len(param_groups):
            raise ValueError("state_dict: number of param groups differs")
        shapes = meta.get("shapes")  # absent in state dicts of zerokern before 2026-12
        if shapes is not None and shapes != self.meta()["shapes"]:
            mine = self.meta()["shapes"]
            if len(shapes) != len(mine):
                raise ValueError(f"state_dict holds {len(shapes)} trainable parameters, this "
                                 f"optimizer has {len(mine)}: it comes from another model")
            i = next(k for k, (a, b) in enumerate(zip(shapes, mine)) if a != b)
            raise ValueError(f"state_dict: parameter {i} has shape {shapes[i]} there and "
                             f"{mine[i]} here: it comes from another model")
        mine = self.meta()
        if any(meta[k] != mine[k] for k in ("stage", "world_size", "rank")):
            raise ValueError(
                f"state_dict holds only rank {meta['rank']}'s shard of a stage-{meta['stage']} "
                f"ZeroAdamW over {meta['world_size']} ranks; this optimizer is rank "
                f"{mine['rank']} of {mine['world_size']} at stage {mine['stage']}. A per-rank "
                "state dict loads only on the rank (world size and stage) that saved it: save "
                "opt.state_dict() on every rank, or use opt.full_state_dict() (torch AdamW "
                "format, loadable anywhere) or zerokern.save_checkpoint")
        if st:
            self.slot.build(param_groups, list(meta.get("ready_order") or []) or None)
            mine = self.meta()
            for k in ("local_numel", "flat_numel", "ready_order"):
                if meta[k] != mine[k]:
                    raise ValueError(
                        f"state_dict was saved with {k}={meta[k]}, this optimizer has {k}="
                        f"{mine[k]}; use zerokern.load_checkpoint to change world size or "
                        "stage")
        eng = self.slot.engine
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
                self.table.steps = [int(x) for x in st["steps"].tolist()]
            elif eng is not None:  # a state saved before any step: a fresh state
                eng.exp_avg.zero_()
                eng.exp_avg_sq.zero_()
                eng.init_master()
                self.table.steps = [0] * len(self.table.params)
        for g, sg in zip(param_groups, state_dict["param_groups"]):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        if scaler is not None and state_dict.get("scaler") is not None:
            scaler.load_state_dict(state_dict["scaler"])
        self.slot.mark_params()  # the loaded master is the one to train from
        self.view.refresh_steps()
