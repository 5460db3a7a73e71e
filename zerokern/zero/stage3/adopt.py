"""A released stage-3 parameter whose ``.data`` was replaced (``p.data = t``; rebind.py says
why torch code does this): this rank's slice takes ``t``'s values, as torch would train ``t``.

Run by Unit.gather before a released unit is gathered, and by the runtime for every released
unit at a step. Another dtype, device or shape (``model.to(torch.bfloat16)``) is refused
before anything changes: the slices cannot follow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..rebind import changed_error

if TYPE_CHECKING:
    from .unit import Unit


def adopt(u: Unit) -> None:
    """Copy the values assigned to ``u``'s placeholders into this rank's slice, put the
    placeholders back and record the parameters in ``ctx.adopted`` (the optimizer's fp32
    master takes them: rebind.adopt_stage3)."""
    ctx = u.ctx
    nan = ctx.nan.data_ptr()
    for j, p in enumerate(u.params):
        if p.data_ptr() == nan or u.plan.numels[j] == 0:
            continue
        if p.dtype != ctx.dtype or p.device != ctx.device or p.shape != u.shapes[j]:
            raise changed_error("shard_model", f"parameter {ctx.param_names.get(id(p), j)!r}",
                                p, ctx.dtype, ctx.device, u.shapes[j], "shard_model")
    for j, p in enumerate(u.params):
        if p.data_ptr() == nan or u.plan.numels[j] == 0:
            continue
        if bool(torch.isnan(p.detach()).all()):
            # The placeholder itself, copied by a conversion that materialises it
            # (Accelerate's prepare of a sharded model does): nothing was assigned.
            p.data = ctx.nan.expand(u.shapes[j])
            continue
        # Through .data: local_params' version counter (ZeroAdamW's sign of weights
        # written into the model) stays; the optimizer takes these via take_adopted().
        flat = p.detach().reshape(-1)
        for sp in u.plan.rank_pieces(ctx.comm.rank):
            if sp.param_index == j:
                ctx.local_params.data.narrow(0, u.shard_start + sp.local_offset,
                                             sp.numel).copy_(
                    flat[sp.param_offset : sp.param_offset + sp.numel])
        p.data = ctx.nan.expand(u.shapes[j])
        ctx.adopted.append(p)
        if ctx.secondary is not None:  # hpZ: its in-node share is older than the slice now
            ctx.secondary.drop(u.index)
