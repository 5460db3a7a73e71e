"""The public sharded-state interface of ZeroAdamW: which elements of each parameter this rank
holds, with writable views of their optimizer state (checkpoints, state interchange and
offload are written against this, never against the engine's buffers).

Compressed state (``ZeroAdamW(moments="bf16" | "int8", master="none")``): each range also
carries its state as stored (``ShardRange.stored``, a ``StoredRange``); its fp32 tensors are
views where the state is fp32 and dequantized copies elsewhere. ``opt.state`` hands out such
copies too, and keeps them in step with the state (below).

About 450 lines: ``opt.state`` accepts the writes torch's AdamW state accepts, each checked
before any applies, and the view, its entry type and the ranges they read read best side by
side."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..quant.blockwise import quantize_blockwise_v2
from ..quant.maps import code_map, dequantize_blockwise

if TYPE_CHECKING:  # type names only: the public types here import nothing of the optimizer
    from .engine_slot import EngineSlot
    from .param_table import ParamTable

MOMENTS = ("exp_avg", "exp_avg_sq")
_KEYS = ("values", *MOMENTS)


@dataclass(frozen=True)
class StoredRange:
    """A range's optimizer state exactly as a compressed ZeroAdamW stores it: writable views of
    its buffers, for consumers that must move the state without changing a bit (checkpoints,
    resharding). int8 codes must travel as codes with their absmax: quantizing the dequantized
    values does not always give them back (the signed map has no -1, so a block whose largest
    magnitude is negative comes back with a smaller absmax).

    ``moments``: how this parameter's moments are stored: "int8" (uint8 codes, one fp32 absmax
    per 256-element block of the parameter; the range starts on a block), "bf16", or "fp32"
    (parameters under 4,096 elements, and ``moments="fp32"``). ``master``: "fp32" (``values``
    is the fp32 master) or "none" (``values`` is the bf16 parameter's own elements, or under
    offload their host copy). ``*_map``: the code maps' ids (int8 only)."""

    moments: str
    master: str
    values: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_absmax: torch.Tensor | None = None
    exp_avg_sq_absmax: torch.Tensor | None = None
    exp_avg_map: str | None = None
    exp_avg_sq_map: str | None = None

    def is_fp32(self, key: str) -> bool:
        """Whether ``key`` ("values", "exp_avg", "exp_avg_sq") is stored as fp32."""
        return getattr(self, key).dtype == torch.float32

    def absmax(self, key: str) -> torch.Tensor | None:
        return getattr(self, f"{key}_absmax")

    def map_id(self, key: str) -> str | None:
        return getattr(self, f"{key}_map")

    def read(self, key: str) -> torch.Tensor:
        """A new fp32 tensor of ``key``: dequantized, widened or copied."""
        raw = getattr(self, key)
        absmax = self.absmax(key) if key != "values" else None
        if absmax is not None:
            return dequantize_blockwise(raw, absmax, code_map(self.map_id(key), raw.device))
        return raw.to(torch.float32, copy=True)

    def write(self, key: str, x: torch.Tensor) -> None:
        """Store the fp32 values ``x`` (numel elements) as ``key`` is stored: quantized per
        block (absmax recomputed), rounded to nearest even (bf16), or copied."""
        raw = getattr(self, key)
        absmax = self.absmax(key) if key != "values" else None
        if absmax is None:
            raw.copy_(x)
            return
        codes, am = quantize_blockwise_v2(x.to(raw.device, torch.float32).reshape(-1),
                                          code_map(self.map_id(key), raw.device))
        raw.copy_(codes)
        absmax.copy_(am)

    def zero_moments(self) -> None:
        """The moments of a fresh state, as the optimizer allocates them (all bytes 0)."""
        for key in MOMENTS:
            getattr(self, key).zero_()
            absmax = self.absmax(key)
            if absmax is not None:
                absmax.zero_()


class ShardRange:
    """Elements [start, start + numel) of one parameter (flattened, row-major) held by this
    rank, with 1-D fp32 tensors of ``numel`` elements: ``values`` (the fp32 master of 16-bit
    parameters, an fp32 parameter's own elements), ``exp_avg`` and ``exp_avg_sq``.

    With the default state (fp32 moments and master) they are views into the optimizer's
    buffers, and writing them changes the optimizer state. With a compressed state
    (``stored`` is set) each is a view where that part is stored in fp32 (the fp32 master;
    the moments of parameters under 4,096 elements, or of ``moments="fp32"``) and otherwise
    an fp32 copy, dequantized or widened when first read (``is_copy``). Inside
    ``ZeroAdamW.edit_shards()`` a copy written in place is stored back on leaving (quantized
    per block, or rounded to nearest even into bf16); elsewhere writing a copy changes
    nothing: use ``write()`` or ``stored``, whose views change the state exactly."""

    __slots__ = ("start", "numel", "stored", "_tensors", "_made")

    def __init__(self, start: int, numel: int, values: torch.Tensor | None = None,
                 exp_avg: torch.Tensor | None = None, exp_avg_sq: torch.Tensor | None = None,
                 stored: StoredRange | None = None) -> None:
        self.start, self.numel, self.stored = start, numel, stored
        given = {"values": values, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        if stored is not None:  # the fp32 parts are their own views
            given = {k: getattr(stored, k) if stored.is_fp32(k) else None for k in _KEYS}
        elif any(t is None for t in given.values()):
            raise TypeError("ShardRange needs values, exp_avg and exp_avg_sq, or stored")
        self._tensors: dict[str, torch.Tensor | None] = given
        self._made: dict[str, int] = {}  # key -> _version of the copy when it was made

    def __repr__(self) -> str:
        fmt = "" if self.stored is None else f", moments={self.stored.moments!r}"
        return f"ShardRange(start={self.start}, numel={self.numel}{fmt})"

    def is_copy(self, key: str) -> bool:
        """Whether ``key``'s fp32 tensor is a copy (not a view of the optimizer's buffer)."""
        return self._tensors[key] is None or key in self._made

    def _get(self, key: str) -> torch.Tensor:
        t = self._tensors[key]
        if t is None:
            assert self.stored is not None
            t = self._tensors[key] = self.stored.read(key)
            self._made[key] = t._version
        return t

    values = property(lambda self: self._get("values"),
                      doc="fp32 values: the master (or a copy of the bf16 parameter).")
    exp_avg = property(lambda self: self._get("exp_avg"), doc="fp32 exp_avg (view or copy).")
    exp_avg_sq = property(lambda self: self._get("exp_avg_sq"),
                          doc="fp32 exp_avg_sq (view or copy).")

    def read(self, key: str) -> torch.Tensor:
        """``key`` in fp32 without keeping a copy here: the view itself, or a new tensor (one
        parameter at a time, a full state dict needs no fp32 copy of the whole state)."""
        t = self._tensors[key]
        if t is not None and key not in self._made:
            return t
        assert self.stored is not None
        return self.stored.read(key)

    def write(self, key: str, x: torch.Tensor) -> None:
        """Store ``numel`` values of ``key`` (any float dtype, read as fp32) into the state,
        in its stored format; a copy handed out here takes them too."""
        with torch.no_grad():
            src = x.reshape(-1)
            if self.stored is None or self.stored.is_fp32(key):
                self._get(key).copy_(src)
                return
            self.stored.write(key, src.to(torch.float32))
            t = self._tensors[key]
            if t is not None:  # the copy shows what is stored now
                t.copy_(self.stored.read(key))
                self._made[key] = t._version

    def zero_moments(self) -> None:
        """Both moments as in a fresh state (the stored bytes zeroed)."""
        with torch.no_grad():
            if self.stored is not None:
                self.stored.zero_moments()
            for key in MOMENTS:
                t = self._tensors[key]
                if t is not None:
                    t.zero_()
                    if key in self._made:
                        self._made[key] = t._version

    def store_written(self) -> list[str]:
        """Store the copies written in place since they were made (ZeroAdamW.edit_shards on
        leaving); returns their keys."""
        out = []
        with torch.no_grad():
            for key, version in list(self._made.items()):
                t = self._tensors[key]
                assert t is not None and self.stored is not None
                if t._version != version:
                    self.stored.write(key, t)
                    self._made[key] = t._version
                    out.append(key)
        return out


@dataclass
class ParamShard:
    """One trainable parameter and the part of its state this rank holds.

    ``ranges`` is empty when this rank holds none of it (stages 1-3 split every parameter's
    elements among the ranks; stage 0 holds everything). ``step`` is the parameter's step
    count (torch.optim.AdamW's ``state[p]["step"]``); inside ``ZeroAdamW.edit_shards()`` it
    may be assigned."""

    index: int  # position among the optimizer's trainable parameters (param-group order)
    name: str | None  # from named parameters or the model passed to shards(); else None
    param: torch.nn.Parameter
    group: int
    shape: torch.Size  # full shape (stage 3: not the released parameter's empty shape)
    dtype: torch.dtype
    step: int
    ranges: tuple[ShardRange, ...]

    @property
    def numel(self) -> int:
        """Elements of the full parameter (all ranks together)."""
        return self.shape.numel()


class ShardedStateView(Mapping):
    """``opt.state`` of a ZeroAdamW: for every trained parameter with a step count above 0
    (torch's AdamW has no state for the others either), this rank's part of its state, as
    FSDP2's sharded optimizer state holds a shard:

    ``{"step": tensor(float), "exp_avg": 1-D, "exp_avg_sq": 1-D, "ranges": [(start, numel)]}``

    The 1-D tensors hold the elements of the flattened parameter listed in ``ranges``, in
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
            empty = getattr(self._slot.engine, key).narrow(0, 0, 0)
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
            "exp_avg": self._moment(sh, "exp_avg"),
            "exp_avg_sq": self._moment(sh, "exp_avg_sq"),
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
        if key in ("exp_avg", "exp_avg_sq"):
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
        raise KeyError(f"opt.state[p] of a ZeroAdamW holds 'step', 'exp_avg', 'exp_avg_sq' "
                       f"and 'ranges' (and, compressed, 'moments' and 'master'); {key!r} "
                       "cannot be written (keep other values outside the optimizer)")

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
        missing = {"step", "exp_avg", "exp_avg_sq"} - set(value)
        if missing:
            raise KeyError(f"opt.state[p] = {{...}}: the state needs 'step', 'exp_avg' and "
                           f"'exp_avg_sq' (missing {sorted(missing)})")
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
