"""The public sharded-state interface of ZeroAdamW: which elements of each parameter this rank
holds, with writable views of their optimizer state (checkpoints, state interchange and
offload are written against this, never against the engine's buffers).

Each range holds the values and the update rule's buffers (for AdamW its two moments,
``exp_avg`` first). Compressed state (``ZeroAdamW(moments="bf16" | "int8", master="none")``):
each range also carries its state as stored (``ShardRange.stored``, a ``StoredRange``); its
fp32 tensors are views where the state is fp32 and dequantized copies elsewhere.
``opt.state`` (state_view.py) hands out such copies too, and keeps them in step with the
state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .stored import Stored


@dataclass(frozen=True)
class StoredRange:
    """A range's optimizer state exactly as a compressed ZeroAdamW stores it: ``values`` and
    the rule's buffers (``state``: name -> ``Stored`` view, zero/stored.py), for consumers
    that must move the state without changing a bit (checkpoints, resharding). int8 codes
    travel as codes with their absmax; ``write`` stores fp32 values as the buffer stores them
    (int8: its format version's quantizer, ``requantize_blockwise`` for version 2,
    ``quantize_blockwise_v3`` for 3), so values read here and written back unchanged keep
    their decoded values bit for bit (and, but for ties in the subnormal range, their codes;
    version 3: blocks whose decoded values are zero or normal).

    ``master``: "fp32" (``values`` is the fp32 master) or "none" (``values`` is the bf16
    parameter's own elements, or under offload their host copy). ``moments``: the format the
    buffers are stored in: "int8", "bf16", or "fp32" (parameters under 4,096 elements, and
    ``moments="fp32"``). Each buffer's raw tensor is also an attribute by its name
    (``exp_avg``), with ``<name>_absmax`` and ``<name>_map`` (int8; else None)."""

    master: str
    values: torch.Tensor
    state: Mapping[str, Stored]

    @property
    def moments(self) -> str:
        return next(iter(self.state.values())).fmt

    @property
    def keys(self) -> tuple[str, ...]:
        """"values" and the rule's buffers."""
        return ("values", *self.state)

    def raw(self, key: str) -> torch.Tensor:
        """``key``'s tensor as stored (the codes for int8)."""
        return self.values if key == "values" else self.state[key].data

    def is_fp32(self, key: str) -> bool:
        """Whether ``key`` ("values" or a buffer's name) is stored as fp32."""
        return self.raw(key).dtype == torch.float32

    def absmax(self, key: str) -> torch.Tensor | None:
        return None if key == "values" else self.state[key].absmax

    def map_id(self, key: str) -> str | None:
        return None if key == "values" else self.state[key].map_id

    def read(self, key: str) -> torch.Tensor:
        """A new fp32 tensor of ``key``: dequantized, widened or copied."""
        if key == "values":
            return self.values.to(torch.float32, copy=True)
        return self.state[key].read()

    def write(self, key: str, x: torch.Tensor) -> None:
        """Store the fp32 values ``x`` (numel elements) as ``key`` is stored: quantized per
        block (absmax recomputed; a decoded block gets its own codes back), rounded to nearest
        even (bf16), or copied."""
        if key == "values":
            self.values.copy_(x)
        else:
            self.state[key].write(x)

    def zero_moments(self) -> None:
        """The buffers of a fresh state, as the optimizer allocates them (all bytes 0)."""
        for s in self.state.values():
            s.zero_()

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__.get("state")
        if state is not None:
            if name in state:
                return state[name].data
            for suffix, attr in (("_absmax", "absmax"), ("_map", "map_id")):
                if name.endswith(suffix) and name[:-len(suffix)] in state:
                    return getattr(state[name[:-len(suffix)]], attr)
        raise AttributeError(name)


class ShardRange:
    """Elements [start, start + numel) of one parameter (flattened, row-major) held by this
    rank, with 1-D fp32 tensors of ``numel`` elements: ``values`` (the fp32 master of 16-bit
    parameters, an fp32 parameter's own elements) and each of the update rule's buffers, an
    attribute by its name (AdamW: ``exp_avg`` and the second moment's).

    With the default state (fp32 buffers and master) they are views into the optimizer's
    buffers, and writing them changes the optimizer state. With a compressed state
    (``stored`` is set) each is a view where that part is stored in fp32 (the fp32 master;
    the buffers of parameters under 4,096 elements, or of ``moments="fp32"``) and otherwise
    an fp32 copy, dequantized or widened when first read (``is_copy``). Inside
    ``ZeroAdamW.edit_shards()`` a copy written in place is stored back on leaving (quantized
    per block, or rounded to nearest even into bf16); elsewhere writing a copy changes
    nothing: use ``write()`` or ``stored``, whose views change the state exactly.

    Args:
        start: the range's first element in the flattened parameter.
        numel: its number of elements.
        tensors: ``"values"`` and each buffer's name -> its fp32 view (the default state).
        stored: the range as stored (a compressed state), instead of ``tensors``.
    """

    __slots__ = ("start", "numel", "stored", "_tensors", "_made")

    def __init__(self, start: int, numel: int, tensors: Mapping[str, torch.Tensor] | None = None,
                 stored: StoredRange | None = None) -> None:
        self.start, self.numel, self.stored = start, numel, stored
        given: dict[str, torch.Tensor | None]
        if stored is not None:  # the fp32 parts are their own views
            given = {k: stored.raw(k) if stored.is_fp32(k) else None for k in stored.keys}
        elif tensors is None or "values" not in tensors:
            # A rule may keep no buffer at all (SGD without momentum): "values" alone.
            raise TypeError("ShardRange needs the values and the buffers' tensors, or stored")
        else:
            given = dict(tensors)
        self._tensors = given
        self._made: dict[str, int] = {}  # key -> _version of the copy when it was made

    def __repr__(self) -> str:
        fmt = "" if self.stored is None else f", moments={self.stored.moments!r}"
        return f"ShardRange(start={self.start}, numel={self.numel}{fmt})"

    @property
    def keys(self) -> tuple[str, ...]:
        """"values" and the names of the rule's buffers."""
        return tuple(self._tensors)

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

    def __getattr__(self, key: str) -> torch.Tensor:
        # A buffer of the rule by its name (r.exp_avg): a view, or a copy made when first read.
        if not key.startswith("_"):
            try:
                tensors = object.__getattribute__(self, "_tensors")
            except AttributeError:
                tensors = {}
            if key in tensors:
                return self._get(key)
        raise AttributeError(f"ShardRange has no {key!r}")

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
        """The rule's buffers as in a fresh state (the stored bytes zeroed)."""
        with torch.no_grad():
            if self.stored is not None:
                self.stored.zero_moments()
            for key, t in self._tensors.items():
                if key != "values" and t is not None:
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
