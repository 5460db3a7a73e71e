"""The order units run in a forward, which prefetching follows (steps 1 and 3 of unit.py).

Pure bookkeeping of unit indices: which units to gather ahead in this forward (the next ones
of the previous forward's order, while this forward follows it), which in the backward (the
units before the one starting its backward, nearest first), and where a unit ran last (the
end-of-backward reduces leftover units in reverse forward order, the same on every rank).
"""

from __future__ import annotations


class ForwardOrder:
    """Unit indices in the order they ran in this forward (``current``) and the previous
    one (``previous``); ``roots`` (the root unit) is never prefetched."""

    def __init__(self, roots: set[int]) -> None:
        self.roots = roots
        self.current: list[int] = []
        self.previous: list[int] = []

    def start(self) -> None:
        """A forward of the root begins (an aborted one left nothing to follow)."""
        self.previous, self.current = self.current or self.previous, []

    def ran(self, index: int) -> None:
        """Unit ``index`` runs its forward now."""
        self.current.append(index)

    def abort(self) -> None:
        """The forward raised: it is not an order to follow."""
        self.current = []

    def forward_prefetch(self, prefetch: int) -> list[int]:
        """The units to gather ahead now: the next ``prefetch`` of the previous forward, as
        long as this one has followed it (otherwise units are gathered on demand, and the
        extra gathers are released at the end of the forward)."""
        k = len(self.current)
        if prefetch <= 0 or self.current[:k] != self.previous[:k]:
            return []
        return self.previous[k : k + prefetch]

    def backward_prefetch(self, index: int, prefetch: int) -> list[int]:
        """The units to gather ahead when unit ``index`` begins its backward: up to
        ``prefetch`` distinct non-root units that ran before its last run, nearest first."""
        if prefetch <= 0 or index not in self.current:
            return []
        todo = [i for i in reversed(self.current[: self.last_pos(index)])
                if i not in self.roots]
        seen: list[int] = []
        for i in todo:
            if i not in seen:
                seen.append(i)
            if len(seen) == prefetch:
                break
        return seen

    def last_pos(self, index: int) -> int:
        """Where unit ``index`` ran last in this forward (-1: it did not run)."""
        if index not in self.current:
            return -1
        return len(self.current) - 1 - self.current[::-1].index(index)
