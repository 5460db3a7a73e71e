"""What the modules see of a stage-3 unit: its parameters as views of the gathered flat
buffer, as aliases of it for the frozen ones under a recompute, or as placeholders (a
zero-stride view of one NaN) while it is released. The unit's verbs (unit.py) decide when;
these say how.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .unit import Unit


def bind(u: Unit, buf: torch.Tensor) -> None:
    """The parameters become views of the full flat buffer ``buf``."""
    for p, shape, off, n in zip(u.params, u.shapes, u.plan.param_offsets,
                                u.plan.numels):
        p.data = buf.narrow(0, off, n).view(shape)


def alias_frozen(u: Unit) -> None:
    # A recompute's saved-tensor hooks keep a tensor that needs no gradient as itself:
    # the Parameter would be read at unpack time, the placeholder once released.
    for mod, name, j in u.slots:
        p = u.params[j]
        if not p.requires_grad:
            mod._parameters[name] = p.detach()
            u.aliased = True


def placeholders(u: Unit) -> None:
    if u.aliased:
        for mod, name, j in u.slots:
            mod._parameters[name] = u.params[j]
        u.aliased = False
    for p, shape in zip(u.params, u.shapes):
        p.data = u.ctx.nan.expand(shape)
