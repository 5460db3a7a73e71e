"""``opt.state`` of a ZeroAdamW (``ShardedStateView``): this rank's part of each trained
parameter's state in torch's per-parameter keys (the update rule's ``torch_keys``: the step
count and the rule's buffers), read and written through the sharded-state interface
(shards.py). It accepts the writes torch's state accepts, each checked before any applies."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .shards import ParamShard

if TYPE_CHECKING:
    from .engine_slot import EngineSlot
    from .param_table import ParamTable


class ShardedStateView(Mapping):
    """``opt.state`` of a ZeroAdamW: for every trained parameter with a step count above 0
    (torch's AdamW has no state for the others either), this rank's part of its state, as
    FSDP2's sharded optimizer state holds a shard:

    ``{"step": tensor(float), "exp_avg": 1-D, ..., "ranges": [(start, numel)]}``: the step
    count and one 1-D tensor per buffer of the update rule, under torch's names (AdamW's two
    moments). The 1-D tensors hold the elements of the flattened parameter listed in ``ranges``, in
    that order (stage 0: all of them; stages 1-3: this rank's). What torch users write into
    ``opt.state`` takes effect, as with torch's AdamW:

    - the moments are views of the optimizer's buffers (this rank's ranges of a parameter
      are always one run of its local space), so ``exp_avg.zero_()``, ``mul_``, ``copy_``
      change the state; assigning ``st["exp_avg"] = t`` copies ``t`` (the full parameter's
      shape, or this rank's 1-D part) into it;
    - ``step`` is one tensor per parameter, kept up to date by step(); writing it in place,
      or assigning ``st["step"] = n``, sets the parameter's step count;
    - ``del opt.state[p]``, ``opt.state[p] = {}``, ``opt.state.clear()`` and
      ``opt.state = defaultdict(dict)`` reset the state (moments zero, step 0): the next
      step starts it afresh, as torch's AdamW does.

    Compressed moments (``moments="bf16"`` or ``"int8"``): the entry also names the format,
    ``"moments"`` (how this parameter's moments are stored: "int8", "bf16", or "fp32" for a
    parameter under 4,096 elements) and ``"master"`` ("fp32" or "none"), and its moments are
    fp32 COPIES, dequantized (torch's AdamW format). A copy is kept in step with the state
    while it is alive: every step(), load and edit refreshes it in place, and what is written
    into it in place (``mul_``, ``copy_``, ``zero_``) is stored, quantized, before the next
    step(), state_dict(), shards() or ``opt.state[p]`` read, as a write into a view would
    have changed the state. Writes that bypass the tensor's version counter (``.data``,
    numpy views) are not seen: write through ``opt.state[p][...] = t``, ``edit_shards`` or
    ``load_state_dict``. Storing quantizes per 256-element block, so a value comes back as
    its nearest code, not bit for bit.

    Anything else (other keys, a state of another shape) is refused with an error."""

    def __init__(self, table: ParamTable, slot: EngineSlot,
                 shards: Callable[[], list[ParamShard]]) -> None:
        # The optimizer's parts this view reads and writes: the step counts (table), the
        # engine's buffers (slot) and ZeroAdamW.shards() (a bound method).
        self._table, self._slot, self._source = table, slot, shards
        self._cache: tuple[Any, dict[int, ParamShard]] | None = None
        # Managed index -> the step tensor handed out, and its _version when it last held
        # the step count: a newer version means it was written in place.
        self._step_t: dict[int, tuple[torch.Tensor, int]] = {}
        # (managed index, moment) -> fp32 copies of compressed moments handed out, each as a
        # weak reference and its _version when it last matched the state.
        self._copies: dict[tuple[int, str], list[tuple[weakref.ref, int]]] = {}
        self._adopting = False  # adopt_moment_writes runs (shards() calls back into it)

    _names = property(lambda self: self._slot.rule.state_names)  # the rule's buffers

    def _shards(self) -> dict[int, ParamShard]:
        eng = self._slot.engine
        if eng is None:
            return {}
        if self._cache is None or self._cache[0] is not eng:
            self._cache = (eng, {id(sh.param): sh for sh in self._source()})
        return self._cache[1]

    # -- step counts handed out as tensors -------------------------------------------------
    def _handed(self, only: int | None) -> list[tuple[int, tuple[torch.Tensor, int]]]:
        if only is None:
            return list(self._step_t.items())
        return [(only, self._step_t[only])] if only in self._step_t else []

    def adopt_step_writes(self, only: int | None = None) -> None:
        """Step tensors written in place since step() last set them: their values become the
        parameters' step counts (before anything of a step is done with the old ones).
        ``only``: that parameter's alone (reading one entry stays O(1))."""
        steps = self._table.steps
        for i, (t, version) in self._handed(only):
            if t._version != version:
                steps[i] = _step_count(t, i)
                self._step_t[i] = (t, t._version)

    def refresh_steps(self, only: int | None = None) -> None:
        """The handed-out step tensors take the step counts (after a step, a load, a reset),
        as torch's AdamW increments ``state[p]["step"]`` in place; without ``only``, the
        handed-out copies of compressed moments take the moments too."""
        steps = self._table.steps
        with torch.no_grad():
            for i, (t, _) in self._handed(only):
                if i < len(steps) and t.item() != steps[i]:
                    t.fill_(steps[i])
                self._step_t[i] = (t, t._version)
        if only is None:
            self.refresh_moments()

    # -- copies of compressed moments handed out ---------------------------------------------
    def _held(self, only: int | None) -> list[tuple[int, str, list[tuple[torch.Tensor, int]]]]:
        """The live copies (of parameter ``only``, or all), dropping the dead ones."""
        out = []
        for (i, key), held in list(self._copies.items()):
            if only is not None and i != only:
                continue
            live = [(t, v) for ref, v in held if (t := ref()) is not None]
            if live:
                out.append((i, key, live))
            else:
                del self._copies[(i, key)]
        return out

    def _mark(self, i: int, key: str, copies: list[torch.Tensor]) -> None:
        self._copies[(i, key)] = [(weakref.ref(t), t._version) for t in copies]

    def adopt_moment_writes(self, only: int | None = None) -> None:
        """Copies of compressed moments written in place since they last matched the state:
        their values are stored (quantized), as a write into a view would have changed the
        state. ``only``: that parameter's alone."""
        if not self._copies or self._adopting:
            return
        self._adopting = True
        try:
            held = self._held(only)
            by_index = self._by_index() if held else {}
            with torch.no_grad():
                for i, key, live in held:
                    for t, version in live:
                        sh = by_index.get(i)
                        if t._version != version and sh is not None and \
                                t.numel() == sum(r.numel for r in sh.ranges):
                            _write_ranges(sh, key, t)
                    self._mark(i, key, [t for t, _ in live])
        finally:
            self._adopting = False

    def refresh_moments(self, only: int | None = None) -> None:
        """The handed-out copies of compressed moments take the stored moments (after a
        step, a load, an edit or a reset of their parameter)."""
        if not self._copies:
            return
        held = self._held(only)
        by_index = self._by_index() if held else {}
        with torch.no_grad():
            for i, key, live in held:
                sh = by_index.get(i)
                if sh is None:
                    continue
                fresh = _concat(sh, key)
                for t, _ in live:
                    if t.numel() == fresh.numel():
                        t.copy_(fresh)
                self._mark(i, key, [t for t, _ in live])

    def _by_index(self) -> dict[int, ParamShard]:
        return {sh.index: sh for sh in self._shards().values()}

    def _step_tensor(self, i: int) -> torch.Tensor:
        if i not in self._step_t:
            t = torch.tensor(float(self._table.steps[i]))
            self._step_t[i] = (t, t._version)
        return self._step_t[i][0]

    # -- reading ----------------------------------------------------------------------------
    def _moment(self, sh: ParamShard, key: str) -> torch.Tensor:
        if any(r.is_copy(key) for r in sh.ranges):  # compressed: a copy, kept in step
            t = _concat(sh, key)
            self._copies.setdefault((sh.index, key), []).append((weakref.ref(t), t._version))
            return t
        parts = [getattr(r, key) for r in sh.ranges]
        if not parts:
            empty = self._slot.engine.state.buffers[key].main.data.narrow(0, 0, 0)
            return empty if empty.dtype == torch.float32 else empty.float()
        for a, b in zip(parts, parts[1:]):
            if b.storage_offset() != a.storage_offset() + a.numel():
                # Buckets are packed without gaps, so a parameter's pieces on one rank are
                # one run of the local space; a copy here would drop the user's writes.
                raise RuntimeError(f"ZeroAdamW: the {key} ranges of parameter {sh.index} "
                                   "are not contiguous on this rank; use opt.edit_shards()")
        return parts[0].as_strided((sum(p.numel() for p in parts),), (1,))

    def _format(self, sh: ParamShard) -> dict[str, str]:
        """The format keys of a compressed state's entry ({} for the default state)."""
        fmt = self._slot.fmt
        if fmt.is_default:
            return {}
        return {"moments": fmt.effective(sh.numel), "master": fmt.master}

    def _entry(self, sh: ParamShard) -> _StateEntry:
        self.adopt_step_writes(sh.index)
        self.adopt_moment_writes(sh.index)
        self.refresh_steps(sh.index)
        if self._table.steps[sh.index] == 0:
            return _StateEntry(self, sh, {})
        return _StateEntry(self, sh, {
            "step": self._step_tensor(sh.index),
            **{key: self._moment(sh, key) for key in self._names},
            "ranges": [(r.start, r.numel) for r in sh.ranges], **self._format(sh)})

    def __getitem__(self, p: Any) -> dict[str, Any]:
        sh = self._shards().get(id(p))
        return {} if sh is None else self._entry(sh)

    def __contains__(self, p: object) -> bool:
        sh = self._shards().get(id(p))
        return sh is not None and self._table.steps[sh.index] > 0

    def __iter__(self) -> Iterator[torch.nn.Parameter]:
        return (sh.param for sh in self._shards().values()
                if self._table.steps[sh.index] > 0)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    # -- writing ----------------------------------------------------------------------------
    def _managed(self, p: Any) -> ParamShard:
        if self._slot.engine is None and self._table.index.get(id(p)) is not None:
            raise RuntimeError("ZeroAdamW: no optimizer state exists before the first "
                               "step(); write opt.state after it")
        sh = self._shards().get(id(p))
        if sh is None:
            raise KeyError("opt.state: this tensor is not a parameter trained by this "
                           "ZeroAdamW")
        return sh

    def _writer(self, sh: ParamShard, key: str, value: Any) -> Any:
        """Check ``opt.state[p][key] = value``; return what applies it (nothing changes
        before every assignment of a statement is checked)."""
        if key == "step":
            n = _step_count(value, sh.index)
            return lambda: self._set_step(sh.index, n, value)
        if key in ("moments", "master") and self._format(sh):
            if value != self._format(sh)[key]:
                raise ValueError(f"opt.state[p][{key!r}] is {self._format(sh)[key]!r}, fixed "
                                 f"when the ZeroAdamW was built; got {value!r} (to change "
                                 "the format, load a state into a ZeroAdamW built with it)")
            return lambda: None
        if key in self._names:
            if not torch.is_tensor(value):
                raise TypeError(f"opt.state[p][{key!r}] must be a tensor, got "
                                f"{type(value).__name__}")
            local = sum(r.numel for r in sh.ranges)
            if tuple(value.shape) == tuple(sh.shape):
                flat = value.detach().reshape(-1)

                def apply() -> None:
                    for r in sh.ranges:
                        r.write(key, flat[r.start:r.start + r.numel])
                    self.refresh_moments(sh.index)
                return apply
            if value.dim() == 1 and value.numel() == local:
                if any(r.is_copy(key) for r in sh.ranges):
                    def apply_local() -> None:
                        _write_ranges(sh, key, value.detach())
                        self.refresh_moments(sh.index)
                    return apply_local
                dst = self._moment(sh, key)
                return lambda: dst.copy_(value.detach())
            raise ValueError(
                f"opt.state[p][{key!r}]: a tensor of shape {tuple(value.shape)}; give the "
                f"parameter's shape {tuple(sh.shape)} or this rank's 1-D part ({local} "
                "elements, as opt.state[p] holds it)")
        held = ", ".join(map(repr, ("step", *self._names)))
        raise KeyError(f"opt.state[p] of a ZeroAdamW holds {held} and 'ranges' (and, "
                       f"compressed, 'moments' and 'master'); {key!r} cannot be written (keep "
                       "other values outside the optimizer)")

    def _set_step(self, i: int, n: int, value: Any) -> None:
        self._table.steps[i] = n
        t = value if torch.is_tensor(value) and value.numel() == 1 else None
        if t is None:
            t = self._step_t[i][0] if i in self._step_t else torch.tensor(float(n))
            with torch.no_grad():
                t.fill_(n)
        self._step_t[i] = (t, t._version)

    def assign(self, sh: ParamShard, items: Mapping[str, Any]) -> None:
        appliers = [self._writer(sh, k, v) for k, v in items.items()]
        for apply in appliers:
            apply()

    def reset(self, sh: ParamShard) -> None:
        """The parameter's state as before its first step: the next step starts it anew."""
        for r in sh.ranges:
            r.zero_moments()
        self._set_step(sh.index, 0, 0)
        self.refresh_moments(sh.index)

    def __setitem__(self, p: Any, value: Mapping[str, Any]) -> None:
        sh = self._managed(p)
        if not isinstance(value, Mapping):
            raise TypeError(f"opt.state[p] = ... takes a dict, got {type(value).__name__}")
        if not value:
            self.reset(sh)
            return
        needed = ("step", *self._names)
        missing = set(needed) - set(value)
        if missing:
            raise KeyError(f"opt.state[p] = {{...}}: the state needs "
                           f"{', '.join(map(repr, needed))} (missing {sorted(missing)})")
        self.assign(sh, {k: v for k, v in value.items() if k != "ranges"})

    def __delitem__(self, p: Any) -> None:
        if p not in self:
            raise KeyError(p)
        self.reset(self._managed(p))

    def clear(self) -> None:
        for sh in self._shards().values():
            self.reset(sh)

    def __reduce__(self) -> Any:
        # copy.deepcopy / pickle (torch.optim.Optimizer.__getstate__ pickles opt.state): a
        # plain dict of the entries, a snapshot apart from the optimizer (its parts hold the
        # engine's arenas, which do not pickle).
        return (dict, (dict(self),))

    def replace(self, value: Any) -> None:
        """``opt.state = ...``: the reset idiom (an empty dict) resets every parameter's
        state; anything else is refused."""
        if value is self:
            return
        if isinstance(value, Mapping) and not value:
            self.clear()
            return
        raise TypeError("opt.state = ... of a ZeroAdamW takes an empty dict (the reset "
                        "idiom opt.state = defaultdict(dict)); to load a state use "
                        "opt.load_state_dict(...) or write opt.state[p][...]")


def _concat(sh: ParamShard, key: str) -> torch.Tensor:
    """This rank's elements of ``key`` in fp32 (``sh.ranges`` in order): a new tensor where
    the ranges hold copies (or more than one range), else the view itself."""
    parts = [r.read(key) for r in sh.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _write_ranges(sh: ParamShard, key: str, t: torch.Tensor) -> None:
    """Store ``t`` (this rank's elements of ``key``, ranges in order) range by range."""
    off = 0
    for r in sh.ranges:
        r.write(key, t.narrow(0, off, r.numel))
        off += r.numel


def _step_count(value: Any, index: int) -> int:
    try:
        v = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"step of parameter {index}: a number, got {value!r}") from None
    if not (math.isfinite(v) and v >= 0 and v == int(v)):
        raise ValueError(f"step of parameter {index} must be a whole number >= 0, got {v}")
    return int(v)


class _StateEntry(dict):
    """``opt.state[p]``: a dict whose assignments go to the optimizer's state."""

    def __init__(self, view: ShardedStateView, sh: ParamShard, items: dict[str, Any]) -> None:
        super().__init__(items)
        self._view, self._param = view, sh.param

    def __setitem__(self, key: str, value: Any) -> None:
        self.update({key: value})

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        items = dict(*args, **kwargs)
        # The shard as it is now (add_param_group re-lays the buffers out).
        sh = self._view._managed(self._param)  # noqa: SLF001
        self._view.assign(sh, items)
        fresh = self._view._entry(sh)  # noqa: SLF001
        super().clear()
        super().update(fresh)

    def __reduce__(self) -> Any:
        # copy.deepcopy / torch.save: a plain dict, a snapshot apart from the optimizer.
        return (dict, (dict(self),))

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a key of opt.state[p] cannot be removed; del opt.state[p] resets "
                        "the parameter's whole state")

    __delitem__ = pop = popitem = clear = _refuse  # type: ignore[assignment]
