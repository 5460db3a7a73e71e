"""Stage 3 and activation checkpointing: forwards run again inside a backward.

torch.utils.checkpoint runs a region's forward a second time during the backward: with
``use_reentrant=False`` when autograd first unpacks a tensor the region saved (under
checkpoint's own saved-tensor hooks, which keep ``x.detach()`` of what the recompute saves,
and a tensor that needs no gradient as itself); with ``use_reentrant=True`` in the backward of
the region's autograd Function, followed by a backward of its own, a graph task nested in the
outer one. Wherever the regions lie (one unit, several, units finer than the region, layers
outside any unit, inside a unit, nested), the runtime follows these rules:

- A unit whose forward runs again is gathered for it into a buffer of its own
  (``Unit.gather(own=True)``; one gathered in the arena is copied out of it), and the
  modules see its frozen parameters as detached aliases of that buffer. What a recompute
  saves are views of the parameters (``weight.t()``) or a frozen parameter itself, read later
  in the backward, possibly after the unit's gradients were all in and it was reduced and
  released: a released arena block goes to the next unit, a released parameter becomes the
  placeholder (NaN). An own buffer lives as long as a tensor saved from it.
- It stays gathered until its backward reduces it (or the backward ends). The recompute is
  not a forward of the step: it is not recorded in the order prefetching follows, releases
  nothing, and enters no root hooks. Gathers outside a recompute stay in the arena.
- A region inside a unit's forward gathers the unit the same way when it calls one of its
  submodules (a pre-forward hook on each); the arena block it leaves stays reserved until
  the backward ends, as the region may have saved views of it before that call. What no hook
  sees stays gathered until the backward ends (``keeps_gathered``), so its arena block is
  not reused: the root, which a region over layers outside any unit reads, and a unit whose
  own module holds parameters that get no gradient.
- When no saved-tensor hooks are active (the reentrant recompute), a recomputed unit's
  forward runs under hooks that keep every saved tensor as a detached alias, as
  checkpoint's do: autograd otherwise keeps a parameter saved as itself
  (``torch.addmm(b, x, weight)``, HF's Conv1D) and reads its ``.data`` when unpacking.
- The backward nested in the outer one ends first: the end-of-backward callback (which
  reduces what is left, releases everything and runs the optimizer's callbacks) is queued
  on the outer backward only (``Recompute.nested``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .unit import Unit


def _alias(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def in_backward_now() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward now is a
    recompute)."""
    return torch._C._current_graph_task_id() != -1


def slots(u: Unit, owner: dict[int, tuple[Unit, int]]) -> list[tuple[torch.nn.Module, str, int]]:
    """Where ``u``'s parameters are registered (module, name, index in ``u.params``): where
    a gather in a backward presents the frozen ones as aliases (Unit.gather(own=True))."""
    out, seen = [], set()
    for m in u.module.modules(remove_duplicate=False):
        for name, p in m._parameters.items():
            if p is None or (id(m), name) in seen or owner.get(id(p), (None,))[0] is not u:
                continue
            seen.add((id(m), name))
            out.append((m, name, owner[id(p)][1]))
    return out


def keeps_gathered(u: Unit, reduces: Callable[[torch.nn.Parameter], bool]) -> bool:
    """Whether ``u`` stays gathered when its gradients are all in, until the backward ends:
    the root, which a region over layers outside any unit reads, and a unit whose own module
    (not a submodule, whose forward would gather it again) holds parameters that get no
    gradient here, which a region inside its forward may read after that."""
    return u.is_root or any(mod is u.module and not (u.params[j].requires_grad
                                                     and reduces(u.params[j]))
                            for mod, _, j in u.slots)


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

    def enter(self, task: int) -> None:
        """A unit's recomputed forward begins (its pre-forward hook) in backward ``task``."""
        if self.task is None:
            self.task = task
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
