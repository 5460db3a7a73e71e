"""The GradGuards of one ZeroAdamW (grad_guard.py says what a guard is): one per trained
parameter, when they go on ``p.grad`` and come off, the scaling torch's utilities recorded
on them, and the norms they answer with.

The guards go on at the end of every synchronised backward (the optimizer arms this once per
backward, keyed by autograd's graph task: a backward that raised never runs its callbacks),
come off when the next backward starts accumulating (a hook on every parameter, run before
autograd writes ``.grad``), while the optimizer itself reads the real gradients, and for good
when the step ends or ``zero_grad()`` drops the gradients. The hooks hold this set weakly: an
optimizer dropped by the script must not live on through its parameters' hooks, nor act on
their gradients.

A guard that is no longer on its parameter when it comes off was replaced by the script
(``p.grad = t`` or ``p.grad = None`` after backward): ``edited`` hears of it (grad_edits.py).

Stages 1-3 keep no whole gradient after the step (stage 1 only this rank's slices of it), so
the guards of the parameters it updated stay on as *stale* guards until the next backward: a
script that clears its gradients (``model.zero_grad()``) replaces them, one that does not
leaves them there, and only then did a gradient really carry over (torch would add it to the
next one): ``stale`` hears which.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .grad_guard import GradGuard


class GuardSet:
    """Guards for ``params`` (the optimizer's list of trained parameters, which grows in
    place with add_param_group; ``watch`` the new ones).

    ``measure()`` gives every parameter's squared norm of its averaged gradient over all
    ranks and the factor that scales them (clipping over loss scale): the optimizer's
    reduction, shared with the step."""

    def __init__(self, params: list[torch.nn.Parameter],
                 measure: Callable[[], tuple[list[float], float]],
                 edited: Callable[[dict[int, torch.Tensor | None]], None] | None = None,
                 stale: Callable[[list[int], list[int], list[int]], None] | None = None
                 ) -> None:
        self._params = params
        self._measure = measure
        # edited(edits): by index, what the script put on p.grad in place of the guard.
        # stale(carried, cleared, zeroed): the last step's guards at the next backward.
        self._edited = edited
        self._stale = stale
        self.stale_on = False  # stale guards may be on the parameters
        self._guards: list[GradGuard | None] = []  # one slot per watched parameter
        self.on = False  # the guards are on the parameters now
        self._cb_task = -1  # the backward (graph task) whose end installs them
        self._norm_cache: list[float] | None = None
        self._hooks: list[Any] = []

    def watch(self, params: list[torch.nn.Parameter]) -> None:
        """Guard slots for new trained parameters, and a hook on each that runs before
        autograd accumulates into it: a new backward has begun, so the real ``.grad``
        (stages 0-1: the bucket view; otherwise None) goes back first."""
        me = weakref.ref(self)
        self._guards += [None] * len(params)
        self._hooks += [p.register_hook(functools.partial(_before_accumulate, me,
                                                          weakref.ref(p)))
                        for p in params]

    def arm(self, install: Callable[[], None]) -> None:
        """In a gradient hook of a synchronised backward: ``install`` runs when this backward
        ends (after every hook of it), once per backward."""
        task = torch._C._current_graph_task_id()
        if task != self._cb_task:
            self._cb_task = task
            torch.autograd.Variable._execution_engine.queue_callback(install)

    def install(self) -> None:
        """Every trained parameter's ``.grad`` becomes its GradGuard (the real one, if any,
        kept on the guard), so torch's clipping utilities either compute the global norm or
        are refused, whatever the stage."""
        self.settle_stale()
        for i, p in enumerate(self._params):
            g = self._guards[i]
            if g is None:
                g = self._guards[i] = GradGuard(p, self, i)
            if p.grad is not g:
                g.zk_held = p.grad
                g.zk_coef = 1.0
                p.grad = g
        self.on = True

    def lift(self) -> dict[int, torch.Tensor | None]:
        """The real gradients back on the parameters (the recorded scaling stays). Returns
        the edits: by index, what the script put on ``p.grad`` in place of its guard."""
        if not self.on:
            return {}
        edits: dict[int, torch.Tensor | None] = {}
        for i, (p, g) in enumerate(zip(self._params, self._guards)):
            if g is None:
                continue
            if p.grad is g:
                p.grad = g.zk_held
            else:
                edits[i] = p.grad
                g.zk_held = None  # the script's tensor is what p.grad holds now
        self.on = False
        return edits

    def _relay(self) -> None:
        for p, g in zip(self._params, self._guards):
            if g is not None and p.grad is not g:
                g.zk_held = p.grad
                p.grad = g
        self.on = True

    @contextmanager
    def lifted(self, relay: bool = True) -> Iterator[None]:
        """The real gradients on the parameters inside the block (the optimizer's own reads);
        the guards go back after it if they were on (``relay=False``: not when the block
        succeeds, because the step ends them anyway; an error leaves ``p.grad`` as it was)."""
        was = self.on
        edits = self.lift()
        done = False
        try:
            if edits and self._edited is not None:
                self._edited(edits)
            yield
            done = True
        finally:
            if was and (relay or not done):
                self._relay()

    def discard(self, stale: list[int] | None = None) -> dict[int, torch.Tensor | None]:
        """The step is over (or its gradients dropped): the real .grad goes back, and the
        guards of ``stale`` (stages 1-3: the parameters the step updated) stay on as stale
        guards, holding it. Returns the edits lift() found; stale guards still on are
        dropped with what they hold."""
        edits = self.lift()
        for p, g in zip(self._params, self._guards):
            if g is not None:
                if g.zk_stale and p.grad is g:
                    p.grad = None
                g.zk_coef, g.zk_held, g.zk_stale = 1.0, None, False
        self.stale_on = False
        self._norm_cache = None
        for i in stale or ():
            g, p = self._guards[i], self._params[i]
            if g is not None and not isinstance(p.grad, GradGuard):
                # Stage 1: the view of the flat gradient, back on p.grad if it carries over.
                g.zk_held, g.zk_stale = p.grad, True
                p.grad = g
                self.stale_on = True
        return edits

    def retire(self) -> None:
        """Their optimizer was superseded: the hooks come off, and every guard still on a
        parameter leaves it None, as when the optimizer is dropped (``_before_accumulate``)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p, g in zip(self._params, self._guards):
            if g is not None and p.grad is g:
                p.grad = None
        self.on = self.stale_on = False

    def settle_stale(self) -> None:
        """A backward starts (or ends) after a step of stages 1-3: the stale guards come off.
        One still on ``p.grad`` carried a gradient over (no zero_grad() since the step: what
        it holds goes back, for autograd to add to), one replaced was cleared by the script,
        one zeroed in place holds a kept zero."""
        if not self.stale_on:
            return
        carried, cleared, zeroed = [], [], []
        for i, (p, g) in enumerate(zip(self._params, self._guards)):
            if g is None or not g.zk_stale:
                continue
            if p.grad is g:
                kept_zero = g.zk_coef == 0.0
                (zeroed if kept_zero else carried).append(i)
                p.grad = None if kept_zero else g.zk_held
            elif p.grad is None:
                cleared.append(i)
            g.zk_coef, g.zk_held, g.zk_stale = 1.0, None, False
        self.stale_on = False
        if self._stale is not None:
            self._stale(carried, cleared, zeroed)

    def coef(self) -> float:
        """The one scalar torch's utilities multiplied every guarded gradient by (clipping
        through p.grad); refused, before anything changes, when they differ."""
        coefs = {g.zk_coef for g in self._guards if g is not None and not g.zk_stale}
        if coefs and all(math.isnan(c) for c in coefs):
            return math.nan  # torch's clip by a NaN norm: NaN gradients, as in torch
        if len(coefs) > 1:
            raise RuntimeError(
                "ZeroAdamW: the gradients were scaled through p.grad by different factors "
                "(a clip over some of the parameters only, or clip_grad_value_-like code). "
                "ZeroAdamW clips by one global norm: use opt.clip_grad_norm_(max_norm) "
                "before step(); call opt.zero_grad() to drop this step's gradients")
        return coefs.pop() if coefs else 1.0

    def norms(self) -> list[float]:
        """The 2-norm of every trained parameter's averaged gradient over all ranks (torch's
        norm of p.grad under DDP), after opt.clip_grad_norm_'s clipping. They come with the
        step's one all-reduce: no collective of their own."""
        if self._norm_cache is None:
            sq, scale = self._measure()
            self._norm_cache = [math.sqrt(max(v, 0.0)) * scale for v in sq]
        return self._norm_cache

    def on_new_backward(self) -> None:
        """A backward started accumulating while the guards are on: the real gradients go
        back, unless torch's utilities already scaled them (the new ones would be added to
        the clipped ones, which ZeroAdamW cannot); edits of p.grad since the last backward
        are handed on before autograd adds to ``p.grad``."""
        self.settle_stale()
        if not self.on:
            return
        if any(g is not None and g.zk_coef != 1.0 for g in self._guards):
            raise RuntimeError(
                "ZeroAdamW: the gradients were scaled through p.grad (torch's clip_grad_norm_ "
                "or clip_grads_with_norm_) and then another backward started before step(); "
                "torch would add the new gradients to the clipped ones, which ZeroAdamW "
                "cannot. Clip after the last backward of the step, right before step()")
        edits = self.lift()
        self._norm_cache = None
        if edits and self._edited is not None:
            self._edited(edits)


def _before_accumulate(ref: weakref.ref, pref: weakref.ref, grad: torch.Tensor) -> None:
    """Tensor hook of every trained parameter, run before autograd accumulates into it."""
    guards = ref()
    if guards is not None:
        guards.on_new_backward()
        return
    p = pref()
    if p is not None and isinstance(p.grad, GradGuard):
        # The optimizer was dropped with a stale guard left on (no zero_grad after its last
        # step): the gradient it stood for is gone, and autograd cannot add to it.
        p.grad = None
