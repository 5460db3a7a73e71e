"""Which parameters this rank's forwards reached: the locally unused ones are not waited for.

A unit is reduced in the backward when none of its gradients is due any more, otherwise at the
end of the backward. A parameter that gets no gradient on this rank only (a mixture-of-experts
expert that received no token here, tokens elsewhere) would hold its unit back to the end of
the backward on this rank alone, while the other ranks reduce it in the backward: the ranks
would then issue their reduce-scatters (and gathers) in different orders, which aborts gloo or,
between units of one size, swaps their gradients without a word. DDP's
``find_unused_parameters=True`` finds such parameters by walking the autograd graph after the
forward; so does this, from the root unit's outputs, and the unit no longer waits for them.

A reentrant activation checkpoint (``CheckpointFunctionBackward``, HF's default) hides its
region's parameters from that graph until its recompute, which runs inside that node's
backward. So each such node found gets a hook that runs when it has finished: every gradient
of its region has arrived by then. A unit whose whole forward that region held (the unit
ran in its recompute, or the region's function is the unit's forward, as HF's
``gradient_checkpointing_enable()`` wraps each decoder layer's) then stops waiting for the
parameters that still have none and that the outer graph does not reach. The node is part of
every rank's graph, so every rank decides at the same point. A unit with regions inside its
forward that are not the whole of it (any of them may still hold a gradient to come) waits
for all its gradients as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

_OPAQUE = "CheckpointFunctionBackward"


class Reached:
    """The ids of the parameters the forwards since the last backward reached, and the units
    whose forward a reentrant checkpoint's recompute ran since its region's last end."""

    def __init__(self, on_region_end: Callable[[Any], None]) -> None:
        self.ids: set[int] = set()
        self.seen_forward = False
        self.opaque = False  # a reentrant checkpoint region hides parameters from the walk
        self.touched: set[int] = set()  # units whose forward ran in a recompute
        self._on_region_end = on_region_end

    def add(self, out: Any) -> None:
        """A root forward returned ``out``: walk its graph to the leaves."""
        self.seen_forward = True
        for node in _walk(out, self.ids):
            self.opaque = True
            fn = getattr(node, "run_function", None)  # the region's function (its ctx)
            node.register_hook(lambda grad_in, grad_out, fn=fn: self._on_region_end(fn))

    def unused(self, params: list[torch.nn.Parameter], waiting: set[int], *,
               region_ended: bool = False) -> set[int]:
        """Of ``waiting`` (indices into ``params``), those no forward reached; none when no
        forward was seen (a backward of a graph built otherwise), or before the end of a
        reentrant checkpoint region when the forward had one (any of them may be hidden in
        it), or when all of them would go (their gradients may come some other way)."""
        if not self.seen_forward or (self.opaque and not region_ended):
            return set()
        out = {j for j in waiting if id(params[j]) not in self.ids}
        return out if region_ended or out != waiting else set()

    def reset(self) -> None:
        """A backward ended: the next forwards start a new set."""
        self.ids, self.seen_forward, self.opaque, self.touched = set(), False, False, set()


def _walk(out: Any, ids: set[int]) -> list[Any]:
    """Add to ``ids`` the parameters ``out``'s graph reaches; return the reentrant checkpoint
    nodes it passed (their regions' parameters are out of its sight)."""
    stack = [t.grad_fn for t in tree_flatten(out)[0]
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    # Keyed by id, holding the node: a C++ node's Python object is made on demand and
    # cached only while alive, so a dropped one's id could come back for another node.
    seen: dict[int, Any] = {id(fn): fn for fn in stack}
    regions = []
    while stack:
        fn = stack.pop()
        kind = type(fn).__name__
        if kind == "AccumulateGrad":  # a leaf that requires grad
            ids.add(id(fn.variable))
            continue
        if kind == _OPAQUE:
            regions.append(fn)
        for nxt, _ in fn.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen[id(nxt)] = nxt
                stack.append(nxt)
    return regions


def region_owners(fn: Any) -> set[int]:
    """The ids of the objects a checkpointed function is the whole forward of: itself (a
    module), the object of a bound method (``self._forward``), the first argument of a
    ``functools.partial`` (HF's ``partial(forward, layer, **kwargs)``)."""
    args = getattr(fn, "args", None)
    first = args[0] if isinstance(args, tuple) and args else None
    return {id(o) for o in (fn, getattr(fn, "__self__", None), first) if o is not None}
