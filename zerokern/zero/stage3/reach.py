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
every rank's graph, so every rank decides at the same point. The units outside every region
decide at their backward, as without one; but a region whose function is not a unit's whole
forward (a lambda, a plain submodule) may hide any unit's parameters: with one in the forward,
a unit outside the regions waits for all its gradients as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

_OPAQUE = "CheckpointFunctionBackward"


class Reached:
    """The parameters reached by the forwards whose graphs a backward may run through, and the
    units whose forward a reentrant checkpoint's recompute ran since its region's last end.

    Each root forward in grad mode is one entry, alive while its graph is (a token held by a
    hook on its outputs' nodes): a forward whose output was dropped without a backward (a
    metric's extra forward, a skipped batch) reached parameters that no backward will bring,
    and counting them would hold a unit back on this rank alone. A backward marks the entries
    done; the next forward drops those (gradient accumulation: the last backward's forward is
    not this one's), while a second backward through a retained graph still has them."""

    def __init__(self, on_region_end: Callable[[Any], None]) -> None:
        self._entries: list[_Entry] = []
        self.touched: set[int] = set()  # units whose forward ran in a recompute
        self._on_region_end = on_region_end
        self._grad_forward = False  # the root forward under way runs with grad
        self._hidden_now: set[int] = set()  # its units run without grad so far

    def begin_forward(self) -> None:
        """A root forward begins (outside a backward)."""
        self._grad_forward, self._hidden_now = torch.is_grad_enabled(), set()

    def ran(self, index: int) -> None:
        """Unit ``index``'s forward begins in a root forward: without grad inside a root
        forward with it, it is in a reentrant checkpoint region's first pass (or a no_grad
        block), out of the walk's sight."""
        if self._grad_forward and not torch.is_grad_enabled():
            self._hidden_now.add(index)

    def add(self, out: Any, units_of: Callable[[Any], set[int]]) -> None:
        """A root forward returned ``out``: walk its graph to the leaves. ``units_of``: the
        units a reentrant region's function is the whole forward of (none: unknown)."""
        self._entries = [e for e in self._entries if not e.done and e.alive()]
        token = _Token()
        entry = _Entry(token)
        roots, regions = _walk(out, entry.ids)
        entry.hidden |= self._hidden_now
        for node in regions:
            fn = getattr(node, "run_function", None)  # the region's function (its ctx)
            whole = units_of(fn)
            # A region over a unit's whole forward hides that unit's parameters and those of
            # the units run inside it (without grad, above); one over something else (a
            # lambda, a plain submodule) may hide any unit's, so none decides before the end
            # of a region.
            entry.hidden |= whole
            entry.opaque |= not whole
            node.register_hook(lambda grad_in, grad_out, fn=fn: self._on_region_end(fn))
        for node in roots:  # the graph holds the token: dropped with it
            node.register_prehook(token)
        self._entries.append(entry)

    def unused(self, params: list[torch.nn.Parameter], waiting: set[int], unit: int, *,
               region_ended: bool = False) -> set[int]:
        """Of ``waiting`` (indices into unit ``unit``'s ``params``), those no forward reached;
        none when no forward's graph lives (a backward of a graph built otherwise), or before
        the end of a reentrant checkpoint region when one may hide some of them, or when all
        of them would go (their gradients may come some other way)."""
        live = [e for e in self._entries if e.alive()]
        if not live or (not region_ended and any(e.opaque or unit in e.hidden for e in live)):
            return set()
        out = {j for j in waiting if all(id(params[j]) not in e.ids for e in live)}
        return out if region_ended or out != waiting else set()

    def reset(self) -> None:
        """A backward ended: the next forward starts a new set."""
        for e in self._entries:
            e.done = True
        self.touched = set()


class _Token:
    """A no-op pre-hook on a forward's output nodes, so that it lives as long as its graph."""

    def __call__(self, grad_outputs: Any) -> None:
        return None


class _Entry:
    """One root forward: the ids of the parameters it reached, which units' parameters a
    reentrant checkpoint region may hide, whether a backward ran since, and whether its graph lives
    (a weak reference to the token only that graph's hooks hold)."""

    def __init__(self, token: _Token) -> None:
        self.ids: set[int] = set()
        self.hidden: set[int] = set()  # units some of whose parameters a region may hide
        self.opaque = False  # a region may hide any unit's parameters
        self.done = False
        self._ref = weakref.ref(token)

    def alive(self) -> bool:
        return self._ref() is not None


def _walk(out: Any, ids: set[int]) -> tuple[list[Any], list[Any]]:
    """Add to ``ids`` the parameters ``out``'s graph reaches; return its root nodes and the
    reentrant checkpoint nodes it passed (their regions' parameters are out of its sight)."""
    stack = [t.grad_fn for t in tree_flatten(out)[0]
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    # Keyed by id, holding the node: a C++ node's Python object is made on demand and
    # cached only while alive, so a dropped one's id could come back for another node.
    seen: dict[int, Any] = {id(fn): fn for fn in stack}
    roots = list(seen.values())
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
    return roots, regions


def region_owners(fn: Any) -> set[int]:
    """The ids of the objects a checkpointed function is the whole forward of: itself (a
    module), the object of a bound method (``self._forward``), the first argument of a
    ``functools.partial`` (HF's ``partial(forward, layer, **kwargs)``)."""
    args = getattr(fn, "args", None)
    first = args[0] if isinstance(args, tuple) and args else None
    return {id(o) for o in (fn, getattr(fn, "__self__", None), first) if o is not None}
