"""Stage 3 and activation checkpointing: a unit's forward run again inside a backward.

torch.utils.checkpoint runs a region's forward a second time during the backward: with
``use_reentrant=False`` when autograd first unpacks a tensor the region saved (under
checkpoint's own saved-tensor hooks, which keep ``x.detach()`` of what the recompute saves);
with ``use_reentrant=True`` in the backward of the region's autograd Function, followed by a
backward of its own, a graph task nested in the outer one. The units whose forward runs there
(whatever the placement: the region is one unit, contains several, contains units finer than
it or layers outside any unit, or lies inside a unit) follow these rules (runtime.py):

- The unit is gathered into a buffer of its own (``Unit.gather(own=True)``), never an arena
  block. The recompute saves views of its parameters (``weight.t()``, the parameter itself)
  that the backward reads later, possibly after the unit's gradients are all in and it was
  reduced and released (a frozen parameter's backward may come last). A released arena block
  goes to the next unit; an own buffer lives as long as a tensor saved from it.
- It stays gathered after the recomputed forward: its backward follows, and reduces and
  releases it as after any forward. Memory: the units of one region at once, as their
  recomputed activations are.
- It is not a forward of the step: not recorded in the forward order that prefetching
  follows, no saved-tensor hooks of the root's forward, no other unit released.
- When no saved-tensor hooks are active (the reentrant recompute), its forward runs under
  hooks that keep every saved tensor as a detached alias (as checkpoint's do): autograd
  otherwise keeps a parameter saved as itself (``torch.addmm(b, x, weight)``, HF's Conv1D)
  and reads its ``.data`` when unpacking, the placeholder (NaN) once the unit is released.
- The backward nested in the outer one ends first: the end-of-backward callback (which
  reduces what is left, releases everything and runs the optimizer's callbacks) is queued
  on the outer backward only (``nested``).
"""

from __future__ import annotations

from typing import Any

import torch


def _alias(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def in_backward_now() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward now is a
    recompute)."""
    return torch._C._current_graph_task_id() != -1


class Recompute:
    """Per sharded model: the backward in which a recompute ran, and the alias hooks the
    recomputed unit forwards pushed."""

    def __init__(self) -> None:
        # The graph task a recompute last ran in, while its end-of-backward is pending:
        # a backward that starts under it is the reentrant checkpoint's nested one.
        self.task: int | None = None
        self._stack: list[Any] = []  # per recomputed unit forward: its hooks, or None

    def nested(self, task: int, callback_task: int) -> bool:
        """Whether backward ``task`` runs inside the one whose end-of-backward callback is
        queued (``callback_task``), as reentrant checkpointing's backward does: a recompute
        ran in that one, which has not ended. (One that raised is forgotten at the next
        forward: ``reset``.)"""
        return self.task is not None and self.task == callback_task and task != callback_task

    def reset(self) -> None:
        """A backward ended, or a new forward begins: no recompute is under way."""
        self.task = None

    def enter(self) -> None:
        """A unit's recomputed forward begins (its pre-forward hook)."""
        hooks = None
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            hooks = torch.autograd.graph.saved_tensors_hooks(_alias, _same)
            hooks.__enter__()
        self._stack.append(hooks)

    def leave(self) -> None:
        """Its forward ended, or raised (an always-called forward hook)."""
        if self._stack:
            hooks = self._stack.pop()
            if hooks is not None:
                hooks.__exit__(None, None, None)
