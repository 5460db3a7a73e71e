"""The public sharded-state interface of ZeroAdamW: which elements of each parameter this rank
holds, with writable views of their optimizer state (checkpoints, state interchange and
offload are written against this, never against the engine's buffers)."""

from __future__ import annotations

from dataclasses import dataclass

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
