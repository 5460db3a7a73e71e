"""Which parameters this rank's forwards reached: the locally unused ones are not waited for.

A unit is reduced in the backward when none of its gradients is due any more, otherwise at the
end of the backward. A parameter that gets no gradient on this rank only (a mixture-of-experts
expert that received no token here, tokens elsewhere) would hold its unit back to the end of
the backward on this rank alone, while the other ranks reduce it in the backward: the ranks
would then issue their reduce-scatters (and gathers) in different orders, which aborts gloo or,
between units of one size, swaps their gradients without a word. DDP's
``find_unused_parameters=True`` finds such parameters by walking the autograd graph after the
forward; so does this, from the root unit's outputs, and the unit no longer waits for them.

A reentrant activation checkpoint (``CheckpointFunctionBackward``) hides its region's
parameters from the graph until its recompute: a forward that has one reaches "everything"
(the units wait for all their gradients, as before).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

_OPAQUE = "CheckpointFunctionBackward"


class Reached:
    """The ids of the parameters the forwards since the last backward reached (``None``:
    every parameter counts as reached)."""

    def __init__(self) -> None:
        self.ids: set[int] | None = set()
        self.seen_forward = False

    def add(self, out: Any) -> None:
        """A root forward returned ``out``: walk its graph to the leaves."""
        self.seen_forward = True
        if self.ids is None:
            return
        stack = [t.grad_fn for t in tree_flatten(out)[0]
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set[int] = set()
        while stack:
            fn = stack.pop()
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            var = getattr(fn, "variable", None)
            if var is not None:  # AccumulateGrad: a leaf that requires grad
                self.ids.add(id(var))
                continue
            if fn.name().endswith(_OPAQUE):
                self.ids = None
                return
            stack.extend(f for f, _ in fn.next_functions if f is not None)

    def unused(self, params: list[torch.nn.Parameter], waiting: set[int]) -> set[int]:
        """Of ``waiting`` (indices into ``params``), those no forward reached; none when no
        forward was seen (a backward of a graph built otherwise) or all of them would go (the
        unit's gradients then arrive some other way, or not at all: it waits as before)."""
        if self.ids is None or not self.seen_forward:
            return set()
        out = {j for j in waiting if id(params[j]) not in self.ids}
        return set() if out == waiting else out

    def reset(self) -> None:
        """A backward ended: the next forwards start a new set."""
        self.ids, self.seen_forward = set(), False
