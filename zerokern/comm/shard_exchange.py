"""Muon's matrices to their owners and back when every rank holds a shard (stages 1-3): two
all-to-alls that move each element once, nothing padded.

At stages 1-3 every element of a matrix lives on exactly one rank of the shard group (its
flat shard, cut into :class:`ShardPiece` runs), and the owner of the matrix
(zerokern.optim.muon_plan) needs the whole matrix once per step. So each rank sends every
owner exactly the runs of that owner's matrices it holds (one ``all_to_all_single`` with
split sizes, :meth:`ShardExchange.to_owners`), the owner places them into its segment, runs
Newton-Schulz there, and sends each rank back exactly the runs it holds
(:meth:`ShardExchange.from_owners`): per step the shard group moves every Muon element twice,
in all, instead of the N-fold of a reduce-scatter and an all-gather over ``world_size``
padded segments, most of them zeros. Runs a rank holds of its own matrices never leave it.

Nothing is summed: each element has one source, so the owner's matrix is the senders' values
bit for bit, as the zero-filled reduce-scatter gave (a value plus zeros).

Every rank must know where every other rank's runs go: the runs of every rank are gathered
once (:meth:`ShardExchange.gather_pieces`, an uncounted object all-gather) and the routes of
each step follow from them and the ``active`` flags (agreed on every rank: the gradient
flags are all-reduced), so the split sizes of sender and receiver always match.

The same two directions asynchronous, overlapped with the step's computation:
zerokern.comm.shard_pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from .collectives import Comm

if TYPE_CHECKING:  # annotations only: zerokern.optim imports zerokern.comm
    from ..optim.muon_plan import MuonPlan


class ShardPiece(NamedTuple):
    """A run of one matrix held by one rank: ``numel`` elements of unit ``unit`` from its
    ``offset``-th element (row-major)."""

    unit: int
    offset: int
    numel: int


class _Routes(NamedTuple):
    send_splits: list[int]  # to owners: elements this rank sends each rank
    recv_splits: list[int]
    put: list[tuple[bool, int]]  # per own piece: (kept here, offset in segment or send buffer)
    recv_at: list[tuple[int, int, int]]  # (offset in receive buffer, in segment, numel)


class ShardExchange:
    """The two all-to-alls of Muon over a sharded flat space, for one plan, one ``Comm`` and
    every rank's runs.

    Holds this rank's segment twice (``grad_segment`` in ``grad_dtype``: the owned matrices'
    inputs; ``param_segment`` in ``param_dtype``: their orthogonalized updates), each
    ``plan.owned_numel[rank]`` elements, and send/receive buffers no larger than this rank's
    runs (to the owners) or its owned elements (back); ``ZeroOptimizer.memory_stats()``
    reports every tensor it holds (zerokern.formulas ``muon_exchange_memory_bytes``).

    Args:
        plan: the owners and segments; its ``world_size`` must be ``comm``'s.
        comm: the shard group.
        pieces: per rank of ``comm``, its runs in its own order (:meth:`gather_pieces`).
        grad_dtype: dtype of what goes to the owners.
        param_dtype: dtype of what comes back.
        device: where the buffers live.

    Raises:
        ValueError: ``plan`` and ``comm`` disagree on the world size, ``pieces`` does not
            have one list per rank, or a run does not lie inside its unit.
    """

    def __init__(self, plan: MuonPlan, comm: Comm, pieces: Sequence[Sequence[ShardPiece]],
                 grad_dtype: torch.dtype, param_dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if plan.world_size != comm.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, comm has "
                             f"{comm.world_size}")
        if len(pieces) != comm.world_size:
            raise ValueError(f"pieces has {len(pieces)} lists, comm {comm.world_size} ranks")
        for r, run in enumerate(pieces):
            for p in run:
                if not (0 <= p.unit < len(plan.units) and p.numel >= 0 and p.offset >= 0
                        and p.offset + p.numel <= plan.units[p.unit].numel):
                    raise ValueError(f"pieces[{r}] has {p}, outside its unit")
        self.plan, self.comm = plan, comm
        self.pieces = [list(run) for run in pieces]
        self.device = torch.device(device)
        own = plan.owned_numel[comm.rank]
        self.grad_segment = torch.zeros(own, dtype=grad_dtype, device=device)
        self.param_segment = torch.zeros(own, dtype=param_dtype, device=device)
        mine = self.pieces[comm.rank]
        away = sum(p.numel for p in mine if self._owner(p) != comm.rank)
        home = own - sum(p.numel for p in mine if self._owner(p) == comm.rank)
        # to the owners: send what this rank holds of others' units, receive the rest of its
        # own; back: the reverse. One buffer per direction and side, reused every step.
        self._send = torch.empty(away, dtype=grad_dtype, device=device)
        self._recv = torch.empty(home, dtype=grad_dtype, device=device)
        self._back_send = torch.empty(home, dtype=param_dtype, device=device)
        self._back_recv = torch.empty(away, dtype=param_dtype, device=device)
        self._key: tuple[bool, ...] | None = None
        self._routes: _Routes | None = None

    @staticmethod
    def gather_pieces(comm: Comm, mine: Sequence[ShardPiece]) -> list[list[ShardPiece]]:
        """Every rank's runs, in rank order: a collective (uncounted: bookkeeping, once per
        layout).

        Args:
            comm: the shard group.
            mine: this rank's runs, in its order.

        Returns:
            One list per rank.
        """
        got = comm.all_gather_object([tuple(p) for p in mine], "Muon shard pieces")
        return [[ShardPiece(*p) for p in run] for run in got]

    @property
    def rank(self) -> int:
        """This rank, in ``comm``."""
        return self.comm.rank

    def _owner(self, p: ShardPiece) -> int:
        return self.plan.units[p.unit].owner

    def _at(self, p: ShardPiece) -> int:
        return self.plan.units[p.unit].offset + p.offset

    def routes(self, active: Sequence[bool]) -> _Routes:
        """Where this step's runs go, for the units whose ``active`` flag is set (indexed
        by unit; the same on every rank)."""
        key = tuple(bool(a) for a in active)
        if key == self._key and self._routes is not None:
            return self._routes
        n, me = self.comm.world_size, self.rank
        live = [[p for p in run if key[p.unit]] for run in self.pieces]
        send = [0] * n
        for p in live[me]:
            if self._owner(p) != me:
                send[self._owner(p)] += p.numel
        start = [sum(send[:o]) for o in range(n)]
        put = []
        for p in live[me]:
            o = self._owner(p)
            if o == me:
                put.append((True, self._at(p)))
            else:
                put.append((False, start[o]))
                start[o] += p.numel
        recv, recv_at, pos = [0] * n, [], 0
        for r in range(n):
            if r == me:
                continue
            for p in live[r]:
                if self._owner(p) == me:
                    recv_at.append((pos, self._at(p), p.numel))
                    recv[r] += p.numel
                    pos += p.numel
        self._key, self._routes = key, _Routes(send, recv, put, recv_at)
        return self._routes

    def _check(self, active: Sequence[bool]) -> list[ShardPiece]:
        if len(active) != len(self.plan.units):
            raise ValueError(f"active has {len(active)} flags, the plan {len(self.plan.units)} "
                             "units")
        return [p for p in self.pieces[self.rank] if active[p.unit]]

    def _pack(self, values: Iterable[torch.Tensor], active: Sequence[bool]) -> _Routes:
        """This step's routes, with this rank's runs placed: its own units' in
        :attr:`grad_segment`, the rest in the send buffer."""
        live = self._check(active)
        rt = self.routes(active)
        count = 0
        for (here, at), p, v in zip(rt.put, live, values):
            if v.numel() != p.numel:
                raise ValueError(f"values[{count}] has {v.numel()} elements, its piece "
                                 f"{p.numel}")
            (self.grad_segment if here else self._send).narrow(0, at, p.numel).copy_(
                v.reshape(-1))
            count += 1
        if count != len(live):
            raise ValueError(f"values has {count} tensors for {len(live)} active pieces")
        return rt

    @torch.no_grad()
    def to_owners(self, values: Iterable[torch.Tensor], active: Sequence[bool],
                  label: str = "Muon updates to owners") -> torch.Tensor:
        """Hand every owner its active units, whole: one all-to-all.

        Args:
            values: this rank's values of its active runs, in its order (one tensor of the
                run's elements per run of an active unit); taken one at a time, so a
                generator computing them holds one at a time.
            active: per unit, whether it is stepped (the same on every rank).
            label: what the collective names in an error.

        Returns:
            :attr:`grad_segment`: every active unit this rank owns, complete
            (:func:`~zerokern.comm.owner_exchange.segment_view`); inactive ones untouched.

        Raises:
            ValueError: ``active`` or ``values`` does not match the plan and the runs
                (raised before anything is sent).
        """
        rt = self._pack(values, active)
        self.comm.all_to_all_uneven(self._recv.narrow(0, 0, sum(rt.recv_splits)),
                                    self._send.narrow(0, 0, sum(rt.send_splits)),
                                    rt.recv_splits, rt.send_splits, label)
        for src, dst, k in rt.recv_at:
            self.grad_segment.narrow(0, dst, k).copy_(self._recv.narrow(0, src, k))
        return self.grad_segment

    @torch.no_grad()
    def from_owners(self, active: Sequence[bool],
                    label: str = "Muon orthogonalized updates") -> list[torch.Tensor]:
        """Hand every rank its runs of :attr:`param_segment` (filled by the owners): one
        all-to-all, the reverse of :meth:`to_owners`.

        Args:
            active: per unit, whether it is stepped (the same on every rank).
            label: what the collective names in an error.

        Returns:
            One flat tensor per active run of this rank, in its order (views of the
            segment or of a receive buffer: read them before the next exchange).

        Raises:
            ValueError: ``active`` does not match the plan.
        """
        live = self._check(active)
        rt = self.routes(active)
        for src, dst, k in rt.recv_at:
            self._back_send.narrow(0, src, k).copy_(self.param_segment.narrow(0, dst, k))
        self.comm.all_to_all_uneven(self._back_recv.narrow(0, 0, sum(rt.send_splits)),
                                    self._back_send.narrow(0, 0, sum(rt.recv_splits)),
                                    rt.send_splits, rt.recv_splits, label)
        return [(self.param_segment if here else self._back_recv).narrow(0, at, p.numel)
                for (here, at), p in zip(rt.put, live)]


__all__ = ["ShardExchange", "ShardPiece"]
