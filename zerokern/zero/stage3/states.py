"""A stage-3 unit's two state machines, as tables: every move a unit makes is checked here, and
one the table does not list raises IllegalTransition naming both states (a bug in the caller,
caught where it happens instead of as a wrong gradient later). unit.py draws them and says
which verb makes which move.
"""

from __future__ import annotations

import enum


class UnitState(enum.Enum):
    """Where a unit's parameters are."""

    SHARDED = "sharded"  # only this rank's slice holds values; the parameters are placeholders
    GATHERING = "gathering"  # gather buffer taken, its all-gather in flight
    GATHERED = "gathered"  # the buffer holds the full parameters; they are views of it
    REDUCING = "reducing"  # released, and its gradients' reduce-scatter is in flight


class GradPhase(enum.Enum):
    """Where a unit is in the gradient side of the current step."""

    IDLE = "idle"  # no backward reached it in this step
    BACKWARD = "backward"  # its backward runs: gathered, gradients due
    REDUCED = "reduced"  # its gradients were reduce-scattered into the shard
    BACKWARD_AGAIN = "backward again"  # a further backward of the same step: adds to the shard


class IllegalTransition(RuntimeError):
    """A unit was asked for a transition its state does not allow: a bug in the caller."""


HOLDS_BUFFER = (UnitState.GATHERING, UnitState.GATHERED)
IN_BACKWARD = (GradPhase.BACKWARD, GradPhase.BACKWARD_AGAIN)

S, G, D, R = UnitState.SHARDED, UnitState.GATHERING, UnitState.GATHERED, UnitState.REDUCING

STORAGE_MOVES: dict[tuple[UnitState, UnitState], str] = {
    (S, G): "gather",  # a buffer taken, the all-gather started
    (G, D): "gather",  # its all-gather waited for (or done at once)
    (G, S): "release",  # prefetched and never used: the buffer goes back
    (D, S): "release",
    (D, R): "reduce",  # the buffer goes back, the gradients' reduce-scatter is in flight
    (S, R): "reduce",  # a unit holding no buffer: its gradients are on .grad all the same
    (R, S): "finish_reduce",
}
"""The storage moves: (from, to) -> the verb that makes it."""

ID, B, RD, BA = GradPhase.IDLE, GradPhase.BACKWARD, GradPhase.REDUCED, GradPhase.BACKWARD_AGAIN

PHASE_MOVES: dict[tuple[GradPhase, GradPhase], str] = {
    (ID, B): "begin_backward",
    (RD, BA): "begin_backward",  # a further backward of the same step
    (B, RD): "end_backward",  # its gradients were reduced
    (BA, RD): "end_backward",  # reduced, or no_sync: the slice keeps the earlier sum
    (B, ID): "end_backward",  # no_sync: the gradients stay on the parameters
    (RD, ID): "new_step",
    (BA, B): "new_step",
}
"""The gradient-phase moves: (from, to) -> the verb that makes it."""


def check_move(unit: str, now: UnitState | GradPhase, to: UnitState | GradPhase) -> None:
    """Raise IllegalTransition unless ``now -> to`` is in its machine's table."""
    table: dict = STORAGE_MOVES if isinstance(now, UnitState) else PHASE_MOVES
    if (now, to) not in table:
        kind = type(now).__name__
        legal = sorted(f"{b.name}" for a, b in table if a is now)
        raise IllegalTransition(
            f"stage 3 unit {unit!r}: {kind}.{now.name} -> {kind}.{to.name} is not a "
            f"transition of the unit (from {now.name} only to: {', '.join(legal) or 'none'})")


def illegal(unit: str, verb: str, now: enum.Enum, allowed: str) -> IllegalTransition:
    """The error of a verb called in a state it does not start from."""
    return IllegalTransition(
        f"stage 3 unit {unit!r}: {verb} is not allowed in {type(now).__name__}."
        f"{now.name} (only from {allowed})")
