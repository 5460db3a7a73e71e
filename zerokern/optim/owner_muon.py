"""A reference distributed Muon with whole-matrix owners: DDP + ``torch.optim.Muon``, sharded.

Every rank holds every parameter and its local gradient (as DDP, or zerokern's stages 0-2).
:meth:`OwnerMuon.step` reduces each matrix's gradient onto its owner only (one
reduce-scatter), the owner keeps that matrix's momentum and runs Newton-Schulz on it once, and
the owners' new values go back to every rank (one all-gather). No rank runs Newton-Schulz on a
matrix it does not own, and each rank keeps momentum for its own matrices only.

The result is ``torch.optim.Muon`` fed the averaged gradient (the sum over ranks, divided once
by N): bit for bit whenever the reduce-scatter's sum equals the all-reduce's, which holds for
any values on 2 ranks (a + b = b + a) and for any world size when the sums are exact (e.g.
integer-valued gradients, as the tests use); otherwise the sums of 3 or more ranks differ in
the order of their additions, by a few units in the last place, as any two all-reduce
algorithms do. A matrix split into row blocks (``row_splits``) is updated as
``torch.optim.Muon`` updates each block given as its own parameter.

The engine hookup uses the pieces directly: :func:`~zerokern.optim.muon_plan.plan_muon`,
:class:`~zerokern.comm.owner_exchange.OwnerExchange` and
:func:`~zerokern.optim.muon.muon_update_` / :func:`~zerokern.optim.muon.muon_update_batched_`,
as :meth:`OwnerMuon.step` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..comm.collectives import Comm
from ..comm.owner_exchange import OwnerExchange, segment_view, unit_view
from .muon import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    check_muon_params,
    muon_update_,
    muon_update_batched_,
)
from .muon_plan import MuonPlan, plan_muon


class OwnerMuon:
    """Muon over a process group, each matrix (or block) updated by one owner rank.

    Args:
        params: the 2-D parameters, the same list in the same order on every rank.
        comm: the group (default: ``Comm()``, the default group or a single process).
        lr: learning rate, as ``torch.optim.Muon``.
        weight_decay: decoupled weight decay, as ``torch.optim.Muon``.
        momentum: momentum factor, as ``torch.optim.Muon``.
        nesterov: Nesterov momentum, as ``torch.optim.Muon``.
        ns_coefficients: Newton-Schulz ``(a, b, c)``, as ``torch.optim.Muon``.
        eps: the norm's floor, as ``torch.optim.Muon``.
        ns_steps: Newton-Schulz iterations, as ``torch.optim.Muon``.
        adjust_lr_fn: learning-rate shape adjustment, as ``torch.optim.Muon``.
        row_splits: parameter index -> row counts of its blocks, each orthogonalized on its
            own (:func:`~zerokern.optim.muon_plan.plan_muon`).
        batched: run one batched Newton-Schulz per group of same-shape units an owner holds
            (bitwise equal to per-matrix on the CPU; see zerokern.optim.muon).

    Attributes:
        hyper: the hyperparameters passed to every update (set ``hyper["lr"]`` to schedule).
        plan: the owners and segments.
        exchange: the two collectives and their buffers.
        momentum: unit index -> its momentum buffer, for the units this rank owns only.

    Raises:
        ValueError: what ``torch.optim.Muon`` raises for these arguments (a parameter that is
            not 2-D, an empty list: torch's own message), parameters of different dtypes or
            devices, or a parameter that is not contiguous; bad ``row_splits``
            (:func:`~zerokern.optim.muon_plan.plan_muon`).
    """

    def __init__(self, params: Iterable[torch.Tensor], comm: Comm | None = None, *,
                 lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                 eps: float = DEFAULT_EPS, ns_steps: int = DEFAULT_NS_STEPS,
                 adjust_lr_fn: str | None = None,
                 row_splits: Mapping[int, Sequence[int]] | None = None,
                 batched: bool = False) -> None:
        self.params = list(params)
        self.hyper: dict[str, Any] = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn)
        check_muon_params(self.params, **self.hyper)  # torch's refusals, torch's words
        first = self.params[0]
        for i, p in enumerate(self.params):
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(f"params[{i}] is {p.dtype} on {p.device}, params[0] "
                                 f"{first.dtype} on {first.device}: one dtype and device")
            if not p.is_contiguous():
                raise ValueError(f"params[{i}] is not contiguous")
        self.comm = comm if comm is not None else Comm()
        self.batched = batched
        self.plan: MuonPlan = plan_muon([tuple(p.shape) for p in self.params],
                                        self.comm.world_size, row_splits=row_splits)
        self.exchange = OwnerExchange(self.plan, self.comm, first.dtype, first.dtype,
                                      first.device)
        # torch keeps momentum as zeros_like(grad), in the gradient's dtype (the parameter's).
        # One contiguous (k, rows, cols) tensor per batch, each unit's buffer a view of it.
        self.momentum: dict[int, torch.Tensor] = {}
        for b in self.plan.batches[self.comm.rank]:
            block = torch.zeros((len(b.units), *b.shape), dtype=first.dtype,
                                device=first.device)
            for j, i in enumerate(b.units):
                self.momentum[i] = block[j]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for Muon beyond the parameters and their gradients:
        ``momentum`` (its own units only) and the exchange's ``grad_buffer`` and
        ``param_buffer`` (zerokern.formulas
        :func:`~zerokern.formulas.muon_owner_memory_bytes`)."""
        ex = self.exchange
        return {"momentum": sum(t.numel() * t.element_size() for t in self.momentum.values()),
                "grad_buffer": ex.grad_buffer.numel() * ex.grad_buffer.element_size(),
                "param_buffer": ex.param_buffer.numel() * ex.param_buffer.element_size()}

    @torch.no_grad()
    def step(self) -> None:
        """One Muon step of every parameter from every rank's ``.grad`` (averaged over the
        ranks); a collective: call it on every rank.

        Raises:
            ValueError: a parameter has no gradient, or one of another shape or dtype
                (before anything is modified or sent).
        """
        grads = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                raise ValueError(f"params[{i}].grad is None: every rank needs every "
                                 f"matrix's gradient (zeros if it took no part)")
            if g.shape != p.shape or g.dtype != p.dtype:
                raise ValueError(f"params[{i}].grad is {g.dtype} {tuple(g.shape)}, the "
                                 f"parameter {p.dtype} {tuple(p.shape)}")
            grads.append(g)
        seg = self.exchange.reduce_to_owners(grads)
        units = self.plan.units
        for b in self.plan.batches[self.comm.rank]:
            views = [(unit_view(self.params[units[i].matrix], units[i]),
                      segment_view(seg, units[i]), self.momentum[i]) for i in b.units]
            if self.batched and len(views) > 1:
                ps, gs, ms = zip(*views)
                muon_update_batched_(ps, gs, ms, **self.hyper)
            else:
                for p, g, m in views:
                    muon_update_(p, g, m, **self.hyper)
        self.exchange.gather_from_owners(self.params)


__all__ = ["OwnerMuon"]
