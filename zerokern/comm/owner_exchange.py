"""Moving whole matrices to their owners and back: two counted collectives per step.

A :class:`~zerokern.optim.muon_plan.MuonPlan` gives every matrix (or block) one owner rank and
lays each owner's units out in one segment of ``segment_numel`` elements. With every rank
holding its local full gradient (stages 0-2, DDP-style), one step is:

1. :meth:`OwnerExchange.reduce_to_owners`: each rank packs its gradients into a buffer of
   ``world_size`` segments, segment ``r`` holding the units rank ``r`` owns; one in-place
   reduce-scatter then leaves each owner, in its own segment, exactly the sum over ranks of
   its units' gradients (on a 2-D mesh summed across the replicate group too), divided once
   by the data-parallel size as every stage averages (sum, then one ``div_``).
2. the owner updates its units (zerokern.optim.muon);
3. :meth:`OwnerExchange.gather_from_owners`: each owner packs its updated units into its
   segment of a parameter-dtype buffer, one in-place all-gather hands every rank every
   segment, and each rank copies the units it does not own into its parameters.

Both collectives go through :class:`~zerokern.comm.Comm`, so they are counted in its
``CommStats`` (``world_size * segment_numel`` elements each; zerokern.formulas
:func:`~zerokern.formulas.muon_exchange_elements`). Only owners touch a unit's gradient sum;
nobody else runs Newton-Schulz on it.

Which exchange: this one when every rank holds every gradient (a real sum per element, so a
reduce-scatter; its padding is only the owners' imbalance, ``MuonPlan.balance()``), as
:class:`~zerokern.optim.owner_muon.OwnerMuon` and the engine's stage 0 (its all-gather only)
do; :class:`~zerokern.comm.shard_exchange.ShardExchange` when every element is on one rank
(the engine's stages 1-3: nothing to sum, so each element goes to its owner alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .collectives import Comm

if TYPE_CHECKING:  # annotations only: zerokern.optim imports this module back
    from ..optim.muon_plan import Batch, MuonPlan, Unit


def unit_view(t: torch.Tensor, unit: Unit) -> torch.Tensor:
    """The ``(rows, cols)`` block of matrix ``t`` that ``unit`` is (its rows, all columns).

    Args:
        t: the unit's matrix (a parameter, its gradient or anything of its shape).
        unit: the unit.

    Returns:
        A view of ``t``.
    """
    return t.narrow(0, unit.row_start, unit.rows)


def segment_view(segment: torch.Tensor, unit: Unit) -> torch.Tensor:
    """``unit``'s ``(rows, cols)`` view of its owner's segment.

    Args:
        segment: an owner's segment, flat.
        unit: one of its units.

    Returns:
        A view of ``segment``.
    """
    return segment.narrow(0, unit.offset, unit.numel).view(unit.rows, unit.cols)


def batch_view(segment: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``batch``'s ``(k, rows, cols)`` view of its owner's segment.

    Args:
        segment: an owner's segment, flat.
        batch: one of its batches.

    Returns:
        A view of ``segment``.
    """
    return segment.narrow(0, batch.offset, batch.numel).view(len(batch.units), *batch.shape)


class OwnerExchange:
    """The two collectives of an owner-sharded update, for one plan and one ``Comm``.

    Holds two buffers of ``world_size * segment_numel`` elements, kept between steps: the
    gradients (``grad_dtype``) and the gathered parameters (``param_dtype``); the received
    sum is this rank's segment of the first, the gather's input its segment of the second.

    Args:
        plan: the owners and segments; its ``world_size`` must be ``comm``'s.
        comm: the group (on a 2-D mesh, the shard group, with ``comm.replicate``).
        grad_dtype: dtype of the gradients (they are summed in it).
        param_dtype: dtype of the parameters.
        device: where the buffers live.

    Raises:
        ValueError: ``plan.world_size`` differs from ``comm.world_size``.
    """

    def __init__(self, plan: MuonPlan, comm: Comm, grad_dtype: torch.dtype,
                 param_dtype: torch.dtype, device: torch.device | str) -> None:
        if plan.world_size != comm.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, comm has "
                             f"{comm.world_size}")
        self.plan, self.comm = plan, comm
        n, s = plan.world_size, plan.segment_numel
        self.grad_buffer = torch.zeros(n * s, dtype=grad_dtype, device=device)
        self.param_buffer = torch.zeros(n * s, dtype=param_dtype, device=device)

    @property
    def rank(self) -> int:
        """This rank, in ``comm``."""
        return self.comm.rank

    def segment(self, buffer: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s segment (default: this rank's) of ``buffer``, a view.

        Args:
            buffer: :attr:`grad_buffer` or :attr:`param_buffer`.
            rank: whose segment.

        Returns:
            The flat ``segment_numel``-element view.
        """
        s = self.plan.segment_numel
        return buffer.narrow(0, (self.rank if rank is None else rank) * s, s)

    def _check(self, name: str, tensors: Sequence[torch.Tensor]) -> None:
        shapes = self.plan.shapes
        if len(tensors) != len(shapes):
            raise ValueError(f"{name} has {len(tensors)} tensors, the plan {len(shapes)}")
        for i, (t, shape) in enumerate(zip(tensors, shapes)):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}, the plan "
                                 f"{shape}")

    @torch.no_grad()
    def reduce_to_owners(self, grads: Sequence[torch.Tensor],
                         label: str = "Muon gradients") -> torch.Tensor:
        """Sum every rank's ``grads`` onto their owners and average: one reduce-scatter.

        Args:
            grads: this rank's local gradient of every matrix, in the plan's order; read,
                not modified.
            label: what the collective names in an error.

        Returns:
            This rank's segment of :attr:`grad_buffer`: the averaged gradient of each unit it
            owns (:func:`segment_view`, :func:`batch_view`), zeros in the padding.

        Raises:
            ValueError: ``grads`` does not match the plan's count or shapes.
        """
        self._check("grads", grads)
        s = self.plan.segment_numel
        if s == 0:
            return self.grad_buffer
        buf = self.grad_buffer
        for u in self.plan.units:
            segment_view(self.segment(buf, u.owner), u).copy_(unit_view(grads[u.matrix], u))
        mine = self.segment(buf)
        self.comm.reduce_scatter(mine, buf, label)
        if self.comm.replicate is not None:  # a 2-D mesh: the other replicas' sums too
            self.comm.replicate_all_reduce(mine, label)
        # zerokern's one averaging of every stage: the sum, then one division by N.
        n = self.comm.dp_size
        if n > 1:
            mine.div_(n)
        return mine

    def gather_segments(self, label: str = "Muon orthogonalized updates") -> torch.Tensor:
        """Every rank's segment of :attr:`param_buffer` to every rank: one all-gather (what
        the engine's stage 0 needs, where every rank applies every update itself).

        Args:
            label: what the collective names in an error.

        Returns:
            :attr:`param_buffer`, every segment filled.
        """
        self.comm.all_gather(self.param_buffer, self.segment(self.param_buffer), label)
        return self.param_buffer

    @torch.no_grad()
    def gather_from_owners(self, params: Sequence[torch.Tensor],
                           label: str = "Muon parameters") -> None:
        """Hand every rank the owners' updated units: one all-gather.

        This rank's owned units are read from ``params`` (already updated by it); every
        other unit is overwritten in ``params`` with its owner's values.

        Args:
            params: this rank's matrices, in the plan's order.
            label: what the collective names in an error.

        Raises:
            ValueError: ``params`` does not match the plan's count or shapes.
        """
        self._check("params", params)
        if self.plan.segment_numel == 0 or self.comm.world_size == 1:
            return  # one rank owns everything, updated in place already
        buf = self.param_buffer
        mine = self.segment(buf)
        for u in self.plan.owned(self.rank):
            segment_view(mine, u).copy_(unit_view(params[u.matrix], u))
        self.comm.all_gather(buf, mine, label)
        for u in self.plan.units:
            if u.owner != self.rank:
                unit_view(params[u.matrix], u).copy_(segment_view(self.segment(buf, u.owner), u))


__all__ = ["OwnerExchange", "batch_view", "segment_view", "unit_view"]
