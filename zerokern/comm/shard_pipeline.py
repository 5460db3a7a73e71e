"""Muon's shard exchange (zerokern.comm.shard_exchange) overlapped with the step: the same two
directions, asynchronous, so that the owner computes while they travel.

The owner-bound all-to-all is issued at once (:meth:`PipelinedShardExchange.start_to_owners`,
a :class:`PendingToOwners`); while it travels the caller runs what does not need it (the
element-wise weight decay of its own elements, Newton-Schulz of the batches this owner holds
whole: :meth:`~PipelinedShardExchange.local_batches`). The results go back in ``chunks``
all-to-alls (:meth:`~PipelinedShardExchange.start_back`, a :class:`PendingBack` each): chunk c
carries the units of every owner's c-th group of batches, its batches in Newton-Schulz order
(those held whole first) cut into groups of about equal Newton-Schulz cost
(:meth:`~PipelinedShardExchange.chunk_batches`), so an owner sends chunk c back while it runs
Newton-Schulz on chunk c + 1, and a rank applies chunk c while chunk c + 1 travels.

Every rank derives the chunks from the plan and every rank's runs (the same on all), so all
issue the same collectives in the same order with matching split sizes. The buffers are the
synchronous exchange's, cut per chunk (nothing more is held), and the elements and bytes moved
are the same (``comm_stats()``: only ``calls`` grows, by ``chunks - 1``). Nothing is computed
differently, only earlier or later: the results are the synchronous schedule's bit for bit.

``events`` records the last step's order of issues (``("issue", "to_owners")``,
``("issue", c)``), waits (``("wait", ...)``) and the caller's :meth:`~PipelinedShardExchange.note`
s in between: which computation ran while which collective was in flight (the tests read it;
no clock).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from .collectives import Handle
from .shard_exchange import ShardExchange, _Routes


class _Back(NamedTuple):
    """One chunk of the way back, as this rank sees it."""

    send_splits: list[int]  # elements to each rank, as the owner
    recv_splits: list[int]  # elements from each owner
    send_at: int  # where the chunk's region starts in the back send buffer
    recv_at: int  # and in the back receive buffer
    copy: list[tuple[int, int, int]]  # (offset in send buffer, in segment, numel)
    mine: list[tuple[int, bool, int, int]]  # per own active run: (index, kept here, at, numel)


class PendingToOwners:
    """The owner-bound all-to-all in flight; :meth:`wait` completes it.

    Args:
        exchange: the exchange that issued it.
        handle: the collective's handle.
        rt: the step's routes (where the received runs go).
    """

    def __init__(self, exchange: PipelinedShardExchange, handle: Handle | None,
                 rt: _Routes) -> None:
        self._ex, self._handle, self._rt = exchange, handle, rt

    def wait(self) -> torch.Tensor:
        """Wait for the other ranks' elements and place them.

        Returns:
            The exchange's ``grad_segment``, complete (as ``to_owners`` returns it).
        """
        ex = self._ex
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
            ex.note("wait", "to_owners")
            for src, dst, k in self._rt.recv_at:
                ex.grad_segment.narrow(0, dst, k).copy_(ex._recv.narrow(0, src, k))
        return ex.grad_segment


class PendingBack:
    """One chunk of results on its way back; :meth:`wait` completes it.

    Args:
        exchange: the exchange that issued it.
        handle: the collective's handle.
        chunk: which chunk.
        back: the chunk's routes (where this rank's runs are).
    """

    def __init__(self, exchange: PipelinedShardExchange, handle: Handle | None, chunk: int,
                 back: _Back) -> None:
        self._ex, self._handle, self.chunk, self._back = exchange, handle, chunk, back

    def wait(self) -> list[tuple[int, torch.Tensor]]:
        """Wait for the chunk.

        Returns:
            ``(i, values)`` per active run of this rank in the chunk: ``i`` its index among
            this rank's active runs (the order of ``from_owners``' list), ``values`` a view
            of the segment or of the receive buffer (read it before the next step).
        """
        ex = self._ex
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
            ex.note("wait", self.chunk)
        return [(i, (ex.param_segment if here else ex._back_recv).narrow(0, at, n))
                for i, here, at, n in self._back.mine]


class PipelinedShardExchange(ShardExchange):
    """:class:`~zerokern.comm.shard_exchange.ShardExchange` with the asynchronous, chunked
    schedule beside its synchronous ``to_owners`` / ``from_owners`` (the same buffers).

    Args:
        *args: as :class:`~zerokern.comm.shard_exchange.ShardExchange`.
        **kwargs: as :class:`~zerokern.comm.shard_exchange.ShardExchange`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple[Any, ...]] = []
        self._chunks: dict[int, tuple[list[list[int]], dict[int, int]]] = {}
        self._back_key: tuple[Any, ...] | None = None
        self._back: list[_Back] = []

    def note(self, *event: Any) -> None:
        """Record what happens now in :attr:`events` (the caller's computation between the
        exchange's issues and waits).

        Args:
            *event: what to record, e.g. ``("ns", batch)``.
        """
        self.events.append(event)

    def _whole(self, owner: int) -> set[int]:
        """The units ``owner`` holds every element of in its own runs."""
        held: dict[int, int] = {}
        for p in self.pieces[owner]:
            if self._owner(p) == owner:
                held[p.unit] = held.get(p.unit, 0) + p.numel
        return {u for u, k in held.items() if k == self.plan.units[u].numel}

    def local_batches(self) -> list[int]:
        """This rank's batches (indices into ``plan.batches[rank]``) whose units it holds
        whole: Newton-Schulz can run on them while the owner-bound all-to-all travels.

        Returns:
            The batch indices, in segment order.
        """
        whole = self._whole(self.rank)
        return [b for b, batch in enumerate(self.plan.batches[self.rank])
                if set(batch.units) <= whole]

    def chunk_batches(self, chunks: int) -> tuple[list[list[int]], dict[int, int]]:
        """Every owner's batches, those it holds whole first, cut into at most ``chunks``
        consecutive groups of about equal Newton-Schulz cost; the same on every rank.

        Args:
            chunks: how many all-to-alls bring the results back, >= 1.

        Returns:
            ``(mine, chunk_of)``: ``mine[c]``, this rank's batches of chunk c in
            Newton-Schulz order; ``chunk_of[u]``, the chunk of unit u.
        """
        if chunks in self._chunks:
            return self._chunks[chunks]
        from ..optim.muon_plan import ns_cost  # zerokern.optim imports zerokern.comm

        chunk_of: dict[int, int] = {}
        mine: list[list[int]] = [[] for _ in range(chunks)]
        for o, batches in enumerate(self.plan.batches):
            whole = self._whole(o)
            order = sorted(range(len(batches)),
                           key=lambda b: (not set(batches[b].units) <= whole, b))
            costs = [len(batches[b].units) * ns_cost(*batches[b].shape) for b in order]
            total, before = max(sum(costs), 1), 0
            for b, cost in zip(order, costs):
                # The chunk of the batch's cost midpoint: consecutive, about total/chunks each.
                c = min(chunks - 1, (2 * before + cost) * chunks // (2 * total))
                before += cost
                chunk_of.update((u, c) for u in batches[b].units)
                if o == self.rank:
                    mine[c].append(b)
        self._chunks[chunks] = (mine, chunk_of)
        return mine, chunk_of

    @torch.no_grad()
    def start_to_owners(self, values: Iterable[torch.Tensor], active: Sequence[bool],
                        label: str = "Muon updates to owners") -> PendingToOwners:
        """``to_owners``, asynchronous: the runs are packed and the all-to-all issued;
        the result's ``wait()`` completes it. Meanwhile only the units this rank holds whole
        may be read from ``grad_segment``.

        Args:
            values: as ``to_owners``.
            active: as ``to_owners``.
            label: what the collective names in an error.

        Returns:
            The pending exchange.

        Raises:
            ValueError: as ``to_owners`` (before anything is sent).
        """
        rt = self._pack(values, active)
        self.events = [("issue", "to_owners")]
        handle = self.comm.all_to_all_uneven(
            self._recv.narrow(0, 0, sum(rt.recv_splits)),
            self._send.narrow(0, 0, sum(rt.send_splits)), rt.recv_splits, rt.send_splits,
            label, async_op=True)
        return PendingToOwners(self, handle, rt)

    def _back_routes(self, active: Sequence[bool], chunks: int) -> list[_Back]:
        key = (tuple(bool(a) for a in active), chunks)
        if key == self._back_key:
            return self._back
        _, chunk_of = self.chunk_batches(chunks)
        put = self.routes(active).put
        n, me = self.comm.world_size, self.rank
        live = [[p for p in run if key[0][p.unit]] for run in self.pieces]
        out, send_at, recv_at = [], 0, 0
        for c in range(chunks):
            # As the owner: each rank's runs of my units in this chunk, in that rank's order
            # (the order in which it lists them below, as a receiver).
            send, copy, pos = [0] * n, [], send_at
            for r in range(n):
                for p in live[r] if r != me else ():
                    if self._owner(p) == me and chunk_of[p.unit] == c:
                        copy.append((pos, self._at(p), p.numel))
                        send[r] += p.numel
                        pos += p.numel
            # As a receiver: from each owner in rank order, my runs of its units, my order.
            recv = [0] * n
            for p in live[me]:
                if chunk_of[p.unit] == c and self._owner(p) != me:
                    recv[self._owner(p)] += p.numel
            at = [recv_at + sum(recv[:o]) for o in range(n)]
            mine = []
            for i, ((here, seg_at), p) in enumerate(zip(put, live[me])):
                if chunk_of[p.unit] != c:
                    continue
                if here:
                    mine.append((i, True, seg_at, p.numel))
                else:
                    o = self._owner(p)
                    mine.append((i, False, at[o], p.numel))
                    at[o] += p.numel
            out.append(_Back(send, recv, send_at, recv_at, copy, mine))
            send_at, recv_at = pos, recv_at + sum(recv)
        self._back_key, self._back = key, out
        return out

    @torch.no_grad()
    def start_back(self, chunk: int, chunks: int, active: Sequence[bool],
                   label: str = "Muon orthogonalized updates") -> PendingBack:
        """Send back chunk ``chunk`` of ``chunks``: its units' ``param_segment`` elements
        (final by now) to the ranks holding them, in one asynchronous all-to-all. Every rank
        calls it for every chunk, in order.

        Args:
            chunk: which chunk, ``0 <= chunk < chunks``.
            chunks: how many (:meth:`chunk_batches`), the same at every call of a step.
            active: per unit, whether it is stepped (the same on every rank).
            label: what the collective names in an error.

        Returns:
            The pending chunk; its ``wait()`` gives this rank's runs of the chunk.

        Raises:
            ValueError: ``active`` does not match the plan, or ``chunk`` is out of range.
        """
        self._check(active)
        if not 0 <= chunk < chunks:
            raise ValueError(f"chunk must be in [0, {chunks}), got {chunk!r}")
        b = self._back_routes(active, chunks)[chunk]
        for src, dst, k in b.copy:
            self._back_send.narrow(0, src, k).copy_(self.param_segment.narrow(0, dst, k))
        self.note("issue", chunk)
        handle = self.comm.all_to_all_uneven(
            self._back_recv.narrow(0, b.recv_at, sum(b.recv_splits)),
            self._back_send.narrow(0, b.send_at, sum(b.send_splits)),
            b.recv_splits, b.send_splits, f"{label} (chunk {chunk} of {chunks})",
            async_op=True)
        return PendingBack(self, handle, chunk, b)


__all__ = ["PendingBack", "PendingToOwners", "PipelinedShardExchange"]
