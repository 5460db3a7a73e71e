"""Several zerokern optimizers over disjoint parameters of one sharded model (torch's Muon
recipe: ``ZeroOptimizer(matrices, torch.optim.Muon, stage=3)`` next to
``ZeroOptimizer(rest, torch.optim.AdamW, stage=3)``).

One backward reduces the gradients of every optimizer's parameters into the runtime's slices
(``local_grads``) at once; each optimizer then reads and steps only its own pieces of them. What
one step's gradients are is the runtime's (the units' gradient phases, ``got_grad``), so it
must not be reset when the first optimizer's step ends, or the second would find its gradients
gone: ``end_own_step`` closes the runtime's step only once every parameter some live optimizer
trains has been consumed (its optimizer stepped or zero_grad-ed), the same decision on every
rank since it depends only on the calls made. Until then the optimizer's own pieces are zeroed
and forgotten (``got_grad``), so a further backward, which adds into the slices of units
already reduced, gives them this backward's gradient alone, as ``zero_grad`` promises, while
the parameters of an optimizer that did not end its step accumulate, as torch's would.

Ownership. A parameter is trained by at most one live optimizer: a new optimizer that takes
part of another's parameters is refused at construction, naming one (both would step it). One
that takes all of them replaces it (``opt = ZeroAdamW(...)`` again, a resume, while the old
object still lives): the old one is *superseded*, its step is refused and its backward
callbacks do nothing.

Weights. At stage 3 whether the weights were written from outside since an optimizer's last
step is read off the version of the shared ``local_params`` (engine_slot.py); another
optimizer's step writes it too, which is not an outside write: ``advance_peers`` carries the
marks of the optimizers that were up to date over such a write.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..interop import optimizer_of
from .states import GradPhase

# The engine slots (engine_slot.py) of the optimizers built on each sharded model's runtime.
_SLOTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def check_disjoint(params: list[torch.nn.Parameter], rt: Any | None, where: str, *,
                   replace: bool = True, me: Any = None) -> list[Any]:
    """Before an optimizer over ``params`` is built (or ``me`` adds them in a param group,
    ``replace=False``): refuse a parameter that another live zerokern optimizer trains,
    unless ``params`` take all of that optimizer's (``replace``: it is replaced). Returns the
    optimizers replaced. ``rt``: the stage-3 runtime, None for a plain model (stages 0-2)."""
    given = {id(p) for p in params}
    replaced: dict[int, Any] = {}

    def conflicts(other: Any) -> bool:
        return not replace or any(id(q) not in given for q in other.managed_params)

    for p in params:
        other = optimizer_of(p)
        if other is None or other is me or id(other) in replaced or is_superseded(other):
            continue
        if conflicts(other):
            # An optimizer is in reference cycles (its hooks, its engine): one the script
            # dropped (del) lives on until the cycle collector runs, which each rank does at
            # its own time. Collect now, so that the answer is the script's on every rank.
            del other
            gc.collect()
            other = optimizer_of(p)
            if other is None or is_superseded(other):
                continue
        if conflicts(other):
            if rt is None:  # stages 0-2: a plain model
                name, on = f"<parameter of shape {tuple(p.shape)}>", "this model"
            else:
                name = rt.param_names.get(id(p), f"<parameter of shape {tuple(rt.shape_of(p))}>")
                on = "this sharded model"
            raise ValueError(
                f"params: parameter {name} is already trained by a live "
                f"{type(other).__name__} on {on}; every parameter belongs to "
                f"at most one optimizer (several optimizers must take disjoint parameters). "
                f"Leave it out of this {where}, or drop (del) the other optimizer first")
        replaced[id(other)] = other
    return list(replaced.values())


def check_offload_alone(rt: Any, offload: Any, replaced: list[Any]) -> None:
    """``offload="cpu"`` moves the model's gradient slices to the host and lands them through
    that optimizer's own staging (context.py): refused next to another live optimizer of the
    model (either one offloading), before anything is built."""
    others = {id(o): o for u in rt.units for p in u.params
              if (o := optimizer_of(p)) is not None and not is_superseded(o)
              and all(o is not r for r in replaced)}
    if others and (offload or any(o.offload for o in others.values())):
        raise ValueError(
            "offload: another zerokern optimizer trains parameters of this sharded model; "
            "offload='cpu' works with one optimizer per shard_model'ed model only (it moves "
            "the model's gradient slices to the host through that optimizer's staging)")


def supersede(old: list[Any], new: Any) -> None:
    """``new`` trains every parameter of each of ``old`` from now on."""
    for o in old:
        o._superseded_by = weakref.ref(new)


def is_superseded(opt: Any) -> bool:
    """Whether a newer optimizer took over all of ``opt``'s parameters (and still lives; at
    stages 0-2 for good: the old one's hooks came off, and its parameters name the newer one,
    so stepping it again after the newer one was dropped would clip by this rank's gradients
    alone, without an error)."""
    if getattr(opt, "_retired", False):
        return True
    ref = getattr(opt, "_superseded_by", None)
    return ref is not None and ref() is not None


def superseded_error(opt: Any, call: str = "step") -> RuntimeError:
    name = type(opt).__name__
    model = ("a model sharded by zerokern.shard_model (ZeRO stage 3)"
             if getattr(opt, "_rt", None) is not None else "the model")
    return RuntimeError(
        f"{name}.{call}(): a newer zerokern optimizer was built over all of this {name}'s "
        f"parameters of {model}: it trains them "
        "now (a parameter belongs to at most one optimizer). Step the new one, and drop (del) "
        "this one. Nothing was updated.")


def register_slot(rt: Any, slot: Any) -> None:
    """An optimizer's engine slot on ``rt``'s model (for ``advance_peers``)."""
    _SLOTS.setdefault(rt, weakref.WeakSet()).add(slot)


def advance_peers(rt: Any, slot: Any, before: Any, after: Any) -> None:
    """``slot``'s optimizer wrote the shared slices (its step), moving their version from
    ``before`` (which its mark held) to ``after``: the other optimizers that were as up to date
    are still (the write was no outside one)."""
    for other in _SLOTS.get(rt, ()):
        if other is not slot and other._versions == before:
            other._versions = after


def end_own_step(engine: Any) -> None:
    """A stage-3 engine's step ended, or its optimizer dropped its gradients (zero_grad): its
    parameters' gradients of this step are consumed. The runtime's step closes when no live
    optimizer's parameter holds unconsumed ones (one optimizer: at once, as before)."""
    rt = engine.rt
    consumed: set[int] = rt.consumed
    consumed.update(id(p) for p in engine.params)
    pending = False
    for u in rt.units:
        for p in u.params:
            if id(p) in consumed or not p.requires_grad:
                continue
            o = optimizer_of(p)
            if o is not None and not is_superseded(o):
                pending = True
                break
        if pending:
            break
    if not pending:
        rt.new_step()
        consumed.clear()
        return
    # Another optimizer's gradients stay for its step: only this one's are dropped. A unit
    # not reduced since the step closed (IDLE) has its slice overwritten by its next reduce,
    # or zeroed at the next step (prepare_step): only the others' pieces are zeroed.
    for p in engine.params:
        rt.got_grad.pop(id(p), None)
    held = [(u.shard_start, u.shard_start + u.plan.shard_numel) for u in rt.units
            if u.phase is not GradPhase.IDLE]
    if not held:
        return
    rt.finish_reduce()  # nothing lands in the slices while they are zeroed
    if rt.grad_sink is not None:
        rt.grad_sink.drain()
    with torch.no_grad():
        for pc in engine.layout.pieces:
            if pc.param < 0 or not pc.numel:
                continue
            at = engine.layout.to_slice(pc.local_start, pc.numel)  # its elements in the slice
            for lo, hi in held:
                a, b = max(lo, at), min(hi, at + pc.numel)
                if a < b:
                    rt.local_grads.narrow(0, a, b - a).zero_()
