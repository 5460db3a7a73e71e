"""What is read and written of this rank's optimizer state from outside the step:
``opt.state`` (the ShardedStateView of state_view.py), ``shards()`` / ``edit_shards()`` (the
public sharded-state interface that checkpoints and the torch-format interchange are written
against, never the engine's buffers) and the per-rank state dict (ZeroAdamW's own format:
this rank's flat buffers in its local layout).

A compressed state (``moments="bf16" | "int8"``, ``master="none"``) is seen through the same
interface: each range carries the state as stored (``ShardRange.stored``: codes, absmax, bf16
moments, the bf16 parameters as values) and fp32 views or dequantized copies of it; the
per-rank state dict holds every stored buffer as it is, with the format and the seed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..comm import Comm
from ..quant.maps import MAP_IDS, decodes_alike
from .engine_slot import EngineSlot
from .param_table import ParamTable
from .rules import UpdateRule
from .scaler import LossScaler
from .shards import ParamShard, ShardRange, StoredRange
from .state_format import StateFormat
from .state_view import ShardedStateView
from .stored import Int8Stored

# The top-level keys of a per-rank state dict (state_dict() below writes exactly these).
_RANK_KEYS = frozenset({"state", "param_groups", "scaler", "zerokern"})


def code_maps(rule: UpdateRule, version: int) -> dict[str, str]:
    """The int8 code map of each of the rule's buffers in format ``version``, as state dicts
    and checkpoints name them (the ids name the format version too)."""
    return {name: rule.map_id(name, version) for name in rule.state_names}


def _format_entry(fmt: StateFormat, seed: int, rule: UpdateRule) -> dict[str, Any]:
    """How a state is stored, as state dicts and checkpoints name it: moments, master, the
    stochastic rounding seed and, for int8, the code maps' ids (which say what the codes
    mean: format version 1/2's dynamic maps or version 3's computed ones)."""
    out: dict[str, Any] = {"moments": fmt.moments, "master": fmt.master, "seed": int(seed)}
    if fmt.blockwise:
        out["maps"] = code_maps(rule, fmt.int8_format)
    return out


def convert_codes(state: Any, saved_maps: dict[str, str]) -> None:
    """Codes copied into ``state`` (a ShardState) as saved under ``saved_maps`` and meant
    otherwise here (another int8 format version): each int8 run decoded on the saved map and
    stored again on this state's (``Int8Stored.write``). Codes of maps that decode alike
    (versions 1 and 2) stay as copied."""
    if state.runs is None:
        return
    for name, buf in state.buffers.items():
        if not isinstance(buf.main, Int8Stored) or decodes_alike(saved_maps[name],
                                                                 buf.main.map_id):
            continue
        for r in state.runs.runs:
            if r.side_start < 0 and r.fmt == "int8":
                part = buf.at(r, 0, r.numel)
                assert part.absmax is not None
                part.write(Int8Stored.decode(part.data, part.absmax, saved_maps[name]))


def set_seed(slot: EngineSlot, seed: int) -> None:
    """The stochastic rounding key of ``master="none"``, restored with a saved state."""
    slot.seed = int(seed)
    eng = slot.engine
    if eng is not None:
        eng.seed = int(seed)
        eng.state.seed = int(seed)


class StateAccess:
    """The optimizer state as seen from outside: ``view`` is ``opt.state``; ``shards`` is
    ZeroAdamW.shards (the view lists its entries through it)."""

    def __init__(self, table: ParamTable, slot: EngineSlot, comm: Comm, *, stage: int,
                 runtime: Any, shards: Callable[[], list[ParamShard]]) -> None:
        self.table, self.slot, self.comm, self.stage, self.rt = table, slot, comm, stage, runtime
        self.view = ShardedStateView(table, slot, shards)

    def adopt_writes(self) -> None:
        """What was written from outside since the engine last wrote: step tensors of
        ``opt.state`` written in place, copies of compressed moments written in place, then
        the parameters' values (engine_slot.py)."""
        self.view.adopt_step_writes()
        self.slot.adopt_param_writes()
        self.view.adopt_moment_writes()

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
        compressed = not eng.state.fmt.is_default
        for pc in L.pieces:
            if pc.param < 0 or (compressed and pc.numel == 0):
                continue
            s, n = pc.local_start, pc.numel
            stored = eng.state.stored(s, n)
            if compressed:
                ranges[pc.param].append(ShardRange(pc.param_offset, n, stored=StoredRange(
                    eng.state.fmt.master, eng.values(s, n), stored)))
                continue
            ranges[pc.param].append(ShardRange(
                pc.param_offset, n, {"values": eng.values(s, n),
                                     **{k: b.data for k, b in stored.items()}}))
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
            for sh in shards:  # compressed: the copies written in place, stored
                for r in sh.ranges:
                    r.store_written()
            self.slot.engine.sync_params(gather)
        self.slot.mark_params(wrote=True)  # edited shards written: our own write
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
                "shapes": [list(sh) for sh in self.table.shapes],
                "state_format": _format_entry(self.slot.fmt, self.slot.seed, self.slot.rule)}

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
        state: dict[str, Any] = {}
        if eng is not None:
            # Every stored buffer as it is (a compressed state's codes and absmax, bf16
            # buffers, the fp32 side buffers of small parameters; None for a part its format
            # lacks): the state round-trips bit for bit.
            stored = self._stored_buffers()
            state = {**{k: t.clone() for k, t in stored.items() if k in eng.state.buffers},
                     "master": None if eng.master is None else eng.master.clone(),
                     "steps": torch.tensor(self.table.steps, dtype=torch.int64),
                     **{k: None if t is None else t.clone() for k, t in stored.items()
                        if k not in eng.state.buffers}}
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
        extra = sorted(set(state_dict) - _RANK_KEYS, key=str)
        if extra:
            raise ValueError(f"state_dict: unknown top-level key {extra[0]!r} in a ZeroAdamW "
                             f"per-rank state dict (it holds {sorted(_RANK_KEYS)}): not a "
                             "state dict this zerokern wrote")
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
        saved_fmt, saved_maps = self._check_format(meta)
        if st:
            self.slot.build(param_groups, list(meta.get("ready_order") or []) or None)
            mine = self.meta()
            for k in ("local_numel", "flat_numel", "ready_order"):
                if meta[k] != mine[k]:
                    raise ValueError(
                        f"state_dict was saved with {k}={meta[k]}, this optimizer has {k}="
                        f"{mine[k]}; use zerokern.load_checkpoint to change world size or "
                        "stage")
            self._check_buffers(st)
            self._check_steps(st.get("steps"))
        eng = self.slot.engine
        if self.slot.fmt.in_place:  # the saved format is this one (checked)
            set_seed(self.slot, saved_fmt["seed"])  # the rounding continues where it was
        with torch.no_grad():
            if st:
                for key, t in self._stored_buffers().items():  # as saved (checked above)
                    if t is not None:
                        t.copy_(st[key])
                convert_codes(eng.state, saved_maps)
                if eng.master is not None and st.get("master") is not None:
                    eng.master.copy_(st["master"])
                elif eng.master is not None:
                    # Saved without offload from fp32 parameters (their own master): an
                    # offloading optimizer's host copy is the parameters themselves.
                    eng.init_master()
                self.table.steps = [int(x) for x in st["steps"].tolist()]
            elif eng is not None:  # a state saved before any step: a fresh state
                eng.state.zero_moments()
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

    def _check_format(self, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """The saved state's format (state dicts of zerokern before issue 27 have none: fp32
        moments and master), refused unless it is this optimizer's: the per-rank state dict
        holds the buffers as stored, in a layout that depends on the format (int8 pads
        parameters to 256-element blocks), so it is not converted here. The int8 format
        version may differ (the same layout): with it the saved code maps (those of
        version 2 when the state dict names none), checked to be known."""
        saved = meta.get("state_format") or {"moments": "fp32", "master": "fp32", "seed": 0}
        fmt = self.slot.fmt
        if not isinstance(saved, dict) or any(k not in saved for k in ("moments", "master")):
            raise ValueError(f"state_dict: 'state_format' must name moments and master, got "
                             f"{saved!r}")
        if (saved["moments"], saved["master"]) != (fmt.moments, fmt.master):
            raise ValueError(
                f"state_dict holds a state with moments={saved['moments']!r}, "
                f"master={saved['master']!r}; this optimizer has moments={fmt.moments!r}, "
                f"master={fmt.master!r}. A per-rank state dict loads only into the format "
                "that saved it (its buffers are kept as stored); to change the format load "
                "opt.full_state_dict() (fp32, quantized on load) or use "
                "zerokern.save_checkpoint / load_checkpoint, which convert through fp32")
        mine = code_maps(self.slot.rule, 2)
        maps = saved.get("maps", mine)
        # Version 1 and 2 map ids decode alike (the same codes, the same scale rule): a state
        # saved by either loads into the other as stored; one of version 3 into a state of
        # version 2 (or the reverse) is converted after the copy (convert_codes).
        if fmt.blockwise:
            if not isinstance(maps, dict) or set(maps) != set(mine):
                raise ValueError(f"state_dict: state_format's maps must name the code maps "
                                 f"of {', '.join(mine)}, got {maps!r:.80}")
            for k, v in maps.items():
                if v not in MAP_IDS:
                    raise ValueError(
                        f"state_dict: state_format.maps[{k!r}] is {v!r:.80}, a code map this "
                        f"zerokern does not know (known: {', '.join(MAP_IDS)}; an int8 format "
                        "version written by a newer zerokern?)")
                if not decodes_alike(v, mine[k]) and not decodes_alike(
                        v, self.slot.rule.map_id(k, 3)):
                    raise ValueError(f"state_dict: state_format.maps[{k!r}] is {v!r}, not a "
                                     f"map of {k} ({mine[k]!r} or its other versions)")
        if fmt.in_place:
            seed = saved.get("seed")
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
                raise ValueError(f"state_dict: the seed must be an int in [0, 2**63), got "
                                 f"{seed!r}")
        return saved, maps

    def _stored_buffers(self) -> dict[str, torch.Tensor | None]:
        """The state's stored tensors besides the master, by per-rank state dict key: the
        rule's buffers, and for a compressed state every part of them (None where absent)."""
        state = self.slot.engine.state
        if state.fmt.is_default:
            return {k: b.main.data for k, b in state.buffers.items()}
        return state.tensors()

    def _check_steps(self, steps: Any) -> None:
        """The per-parameter step counts: an integer tensor, one non-negative count each."""
        n = len(self.table.params)
        if (not torch.is_tensor(steps) or steps.dtype.is_floating_point
                or steps.dtype.is_complex or steps.dtype == torch.bool
                or tuple(steps.shape) != (n,)):
            got = (f"{steps.dtype} of shape {tuple(steps.shape)}" if torch.is_tensor(steps)
                   else repr(steps)[:60])
            raise ValueError(f"state_dict: 'steps' must be an integer tensor of shape ({n},) "
                             f"(one step count per trained parameter), got {got}")
        if bool((steps < 0).any()):
            raise ValueError(f"state_dict: 'steps' holds a negative step count "
                             f"({int(steps.min())})")

    def _check_buffers(self, st: dict[str, Any]) -> None:
        """Each stored buffer of the state dict matches this state's (dtype and length), before
        any is copied."""
        for key, mine in self._stored_buffers().items():
            if mine is None:
                continue
            got = st.get(key)
            if not torch.is_tensor(got):
                raise ValueError(f"state_dict: the state has no tensor {key!r} (this "
                                 f"optimizer stores {mine.numel()} elements of {mine.dtype})")
            if got.dtype != mine.dtype or tuple(got.shape) != tuple(mine.shape):
                raise ValueError(f"state_dict: {key!r} is {got.dtype} of shape "
                                 f"{tuple(got.shape)}, this optimizer stores {mine.dtype} of "
                                 f"shape {tuple(mine.shape)}")
