"""The state of an optimizer split into dtype parts (``MixedState``, a part of
``MixedParts``, mixed.py): ``shards()`` / ``edit_shards()`` in the global order (what
save_checkpoint and load_checkpoint read and write), the per-rank state dict (one per part),
and the torch-format state dict keyed by parameter index across all groups, as torch's."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from .interchange import is_torch_format, strip_adamw_flags
from .mixed_plan import NOT_PUSHED, Part
from .shards import ParamShard


class MixedState:
    """The state methods of ``MixedParts``."""

    _parts: list[Any]
    _plan: list[Part]
    _where: list[tuple[int, int]]
    _torch_index: list[int]
    param_groups: list[dict[str, Any]]

    def _push(self) -> None:
        raise NotImplementedError  # MixedParts'

    def _subgroups(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        raise NotImplementedError  # MixedParts'

    def _pull(self, saved: list[dict[str, Any]] | None = None) -> None:
        """After a load: each user group takes its sub-groups' (loaded) hyperparameters;
        a group with no trained parameter takes ``saved``'s, as torch's load does."""
        done: set[int] = set()
        for g, sub in self._subgroups():
            if id(g) in done:
                continue
            done.add(id(g))
            for k in [k for k in g if k not in sub and k not in NOT_PUSHED]:
                del g[k]
            g.update({k: v for k, v in sub.items() if k not in NOT_PUSHED})
        for gi, g in enumerate(self.param_groups):
            if id(g) not in done and saved is not None:
                new = strip_adamw_flags({k: v for k, v in saved[gi].items()
                                         if k not in NOT_PUSHED}, f" (param group {gi})")
                g.update(new)

    # -- state ------------------------------------------------------------------------------
    def _global(self, k: int, shards: list[ParamShard]) -> list[tuple[int, ParamShard]]:
        pl = self._plan[k]
        return [(pl.managed[sh.index], sh) for sh in shards]

    def _merged(self, per_part: list[list[ParamShard]]) -> list[tuple[ParamShard, ParamShard]]:
        """(shard with the global index and user group, the part's own) in global order."""
        out = []
        for k, shards in enumerate(per_part):
            for g, sh in self._global(k, shards):
                gi = self._plan[k].source[sh.group]
                out.append((g, dataclasses.replace(sh, index=g, group=gi), sh))
        return [(a, b) for _, a, b in sorted(out, key=lambda t: t[0])]

    def _local_orders(self, ready_order: list[int] | None) -> list[list[int] | None]:
        if ready_order is None:
            return [None] * len(self._parts)
        out: list[list[int]] = [[] for _ in self._parts]
        for g in ready_order:
            k, i = self._where[g]
            out[k].append(i)
        return list(out)

    def shards(self, model: torch.nn.Module | None = None, *,
               ready_order: list[int] | None = None) -> list[ParamShard]:
        """Every part's shards, indexed as one optimizer's (``ready_order``: global)."""
        self._push()
        per = [part.shards(model, ready_order=o)
               for part, o in zip(self._parts, self._local_orders(ready_order))]
        return [a for a, _ in self._merged(per)]

    @contextmanager
    def edit_shards(self, model: torch.nn.Module | None = None, *, gather: bool = True,
                    ready_order: list[int] | None = None) -> Iterator[list[ParamShard]]:
        """Every part's ``edit_shards`` at once; the steps written are taken by each part."""
        self._push()
        with ExitStack() as stack:
            per = [stack.enter_context(part.edit_shards(model, gather=gather, ready_order=o))
                   for part, o in zip(self._parts, self._local_orders(ready_order))]
            pairs = self._merged(per)
            yield [a for a, _ in pairs]
            for a, b in pairs:
                b.step = a.step

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of every part's state (``"parts"``, one per-rank state dict
        each), with the parts' dtypes and master options."""
        self._push()
        return {"zerokern": {"parts": [[str(pl.dtype), pl.master] for pl in self._plan]},
                "state": {}, "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                              for g in self.param_groups],
                "parts": [part.state_dict() for part in self._parts]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A per-rank ``state_dict()`` of an optimizer with the same parts, or a torch-format
        state dict (``full_state_dict()``, torch's own, any world size or stage)."""
        if is_torch_format(state_dict):
            self._load_torch(state_dict)
            return
        mine = [[str(pl.dtype), pl.master] for pl in self._plan]
        meta = state_dict.get("zerokern") if isinstance(state_dict, dict) else None
        saved = meta.get("parts") if isinstance(meta, dict) else None
        if saved != mine or len(state_dict.get("parts") or []) != len(mine):
            raise ValueError(f"state_dict: saved by an optimizer with the parts {saved!r} "
                             f"(dtype, master); this one has {mine!r}. Load a torch-format "
                             "state dict (full_state_dict()) to change them")
        self._push()
        self._load_parts(list(state_dict["parts"]))
        self._pull()

    def _load_parts(self, sds: list[dict[str, Any]]) -> None:
        """Load ``sds[i]`` into part i, all or nothing: each part checks its own dict before
        changing anything, but a later part's refusal would leave the earlier ones loaded, so
        their previous state (a copy, this rank's shard: loads are rare) is put back first."""
        done: list[tuple[Any, dict[str, Any]]] = []
        try:
            for part, sd in zip(self._parts, sds):
                before = copy.deepcopy(part.state_dict())
                part.load_state_dict(sd)
                done.append((part, before))
        except BaseException:
            for part, before in reversed(done):
                part.load_state_dict(before)
            raise

    def full_state_dict(self, *, rank0_only: bool = True,
                        cpu_offload: bool = True) -> dict[str, Any]:
        """The whole state in the torch class's format, keyed by parameter index across all
        groups (frozen parameters counted, as torch counts them). A collective."""
        self._push()
        subs = [part.full_state_dict(rank0_only=rank0_only, cpu_offload=cpu_offload)
                for part in self._parts]
        if not subs[0]:
            return {}
        state: dict[int, Any] = {}
        stored_as: dict[int, str] = {}
        fmt: dict[str, Any] | None = None
        for pl, sd in zip(self._plan, subs):
            for i, st in sd["state"].items():
                state[self._torch_index[pl.managed[i]]] = st
            sf = sd.get("state_format")
            if sf is not None:
                fmt = fmt or {k: v for k, v in sf.items() if k != "stored_as"}
                stored_as.update({self._torch_index[pl.managed[i]]: v
                                  for i, v in sf["stored_as"].items()})
        _, groups = self._parts[0]._interchange._torch_numbering(self.param_groups)
        out: dict[str, Any] = {"state": dict(sorted(state.items())), "param_groups": groups}
        if fmt is not None:
            out["state_format"] = {**fmt, "stored_as": stored_as}
        return out

    def _load_torch(self, sd: dict[str, Any]) -> None:
        groups = sd["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} param groups, this optimizer has "
                             f"{len(self.param_groups)}")
        for gi, (g, sg) in enumerate(zip(self.param_groups, groups)):
            if len(sg.get("params", [])) != len(g["params"]):
                raise ValueError(f"state_dict: param group {gi} has {len(sg['params'])} "
                                 f"parameters there and {len(g['params'])} here")
        state = sd["state"]
        self._push()
        outs: list[dict[str, Any]] = []
        for pl, part in zip(self._plan, self._parts):
            sub_groups, sub_state, at = [], {}, 0
            for gi, sub in zip(pl.source, part.param_groups):
                n = len(sub["params"])
                sub_groups.append({**{k: v for k, v in groups[gi].items()
                                      if k not in NOT_PUSHED}, "params": list(range(at, at + n))})
                at += n
            for i, g in enumerate(pl.managed):
                t = self._torch_index[g]
                st = state.get(t, state.get(str(t)))
                if st:
                    sub_state[i] = st
            out = {"state": sub_state, "param_groups": sub_groups}
            if "state_format" in sd:
                out["state_format"] = sd["state_format"]
            outs.append(out)
        self._load_parts(outs)
        self._pull(groups)
