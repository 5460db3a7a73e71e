"""The public sharded-state interface of ZeroAdamW: which elements of each parameter this rank
holds, with writable views of their optimizer state (checkpoints, state interchange and
offload are written against this, never against the engine's buffers)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ShardRange:
    """Elements [start, start + numel) of one parameter (flattened, row-major) held by this
    rank. The tensors are 1-D fp32 views of ``numel`` elements into the optimizer's buffers:
    writing them changes the optimizer state."""

    start: int
    numel: int
    values: torch.Tensor  # fp32 master (16-bit params) or the fp32 parameter's own elements
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


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
        return self.shape.numel()


class ShardedStateView(Mapping):
    """``opt.state`` of a ZeroAdamW: for every trained parameter with a step count above 0
    (torch's AdamW has no state for the others either), this rank's part of its state, as
    FSDP2's sharded optimizer state holds a shard:

    ``{"step": tensor(float), "exp_avg": 1-D, "exp_avg_sq": 1-D, "ranges": [(start, numel)]}``

    The 1-D tensors hold the elements of the flattened parameter listed in ``ranges``, in
    that order (stage 0: all of them; stages 1-3: this rank's). With one range they are views
    of the optimizer's buffers, with several a copy; ``opt.shards()`` gives views always.
    Read-only: write through ``opt.edit_shards()``."""

    def __init__(self, opt: Any) -> None:
        self._opt = opt
        self._cache: tuple[Any, dict[int, ParamShard]] | None = None

    def _shards(self) -> dict[int, ParamShard]:
        opt = self._opt
        eng = opt._engine  # noqa: SLF001 - the view belongs to the optimizer
        if eng is None:
            return {}
        if self._cache is None or self._cache[0] is not eng:
            self._cache = (eng, {id(sh.param): sh for sh in opt.shards()})
        return self._cache[1]

    def _entry(self, sh: ParamShard) -> dict[str, Any]:
        step = self._opt.shards_step(sh.index)
        if step == 0:
            return {}
        out: dict[str, Any] = {"step": torch.tensor(float(step)),
                               "ranges": [(r.start, r.numel) for r in sh.ranges]}
        for key in ("exp_avg", "exp_avg_sq"):
            parts = [getattr(r, key) for r in sh.ranges]
            out[key] = (parts[0] if len(parts) == 1 else torch.cat(parts) if parts
                        else torch.empty(0))
        return out

    def __getitem__(self, p: Any) -> dict[str, Any]:
        sh = self._shards().get(id(p))
        return {} if sh is None else self._entry(sh)

    def __contains__(self, p: object) -> bool:
        sh = self._shards().get(id(p))
        return sh is not None and self._opt.shards_step(sh.index) > 0

    def __iter__(self) -> Iterator[torch.nn.Parameter]:
        return (sh.param for sh in self._shards().values()
                if self._opt.shards_step(sh.index) > 0)

    def __len__(self) -> int:
        return sum(1 for _ in self)
