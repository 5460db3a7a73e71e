"""Muon's step inside the engine: every rank advances its own elements of the momentum, the
matrices go to their owners, each owner orthogonalizes its matrices once, and every rank
applies the owners' results to its own elements (``MuonRuleState.update``, called by
``step()`` in place of the engine's range-by-range update).

torch.optim.Muon's step of a matrix is, op for op::

    buf.lerp_(grad, 1 - momentum)                           # element-wise
    update = grad.lerp(buf, momentum) if nesterov else buf  # element-wise
    update = NS(update)                                     # the whole matrix, in bfloat16
    param.mul_(1 - lr * weight_decay)                       # element-wise
    param.add_(update, alpha=-adjust_lr(lr, shape))         # element-wise

so the element-wise lines run where the elements are (this rank's flat shard: the momentum
is one flat buffer of the rule, sharded to the element like AdamW's moments), and only NS
moves. At stages 1-3 every element is on one rank of the shard group: one all-to-all
(zerokern.comm.shard_exchange) sends each owner exactly the elements of its matrices' updates
that other ranks hold (nothing padded, nothing summed: the owner's matrix is the senders'
values, bit for bit), the owner runs NS once per matrix (batched over same-shape matrices,
zerokern.optim.muon.newton_schulz), and one all-to-all sends each rank back exactly its
elements of the bfloat16 results, which it applies to its elements. At stage 0 every rank
holds every element, so the owner reads its matrices locally and one all-gather of the
owners' segments (zerokern.comm.owner_exchange) hands every rank every result.

At stages 1-3 the two all-to-alls overlap the step (zerokern.comm.shard_pipeline): while the
updates travel to their owners every rank applies the weight decay (``mul_``, needing
nothing from the owner) and the owner orthogonalizes the matrices it holds whole; the results
come back in up to ``chunks`` all-to-alls, each sent while NS runs on the next chunk and
applied while the next travels. Only when each line runs moves, not what it computes: the
same bits as the synchronous schedule (``set_chunks(0)``). The owners
and segments are zerokern.optim.muon_plan's, rebuilt from the shapes and the group size (so
a checkpoint loads at any world size: nothing about the owners is saved). With offload the
element-wise lines run on the host state, the exchange and NS on the engine's device.

On the CPU each line above gives the same bits on a flat slice as on the whole matrix, so
the result is torch.optim.Muon's on the averaged gradient, bit for bit where that average is
(2 ranks: one addition). The exchange's collectives go through the Comm, so ``comm_stats()``
counts them (stages 1-3: ``all_to_all``, the elements this rank sends, zerokern.formulas
``muon_shard_exchange_elements``; stage 0: an all-gather of ``world_size * segment_numel``
elements, ``muon_exchange_elements``; in bytes ``muon_exchange_bytes``), and
``memory_stats()`` reports the buffers of the exchange in use (``muon_exchange_memory_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..comm import Comm
from ..comm.owner_exchange import OwnerExchange, batch_view, segment_view
from ..comm.shard_exchange import ShardPiece
from ..comm.shard_pipeline import PipelinedShardExchange
from ..formulas import muon_exchange_memory_bytes
from ..optim.muon import _addmm, adjust_lr, newton_schulz
from ..optim.muon_plan import MuonPlan, plan_muon
from .layout import Layout
from .param_table import ParamTable
from .rule_state import RuleState
from .rules import UpdateRule
from .stages import Engine, Run

_NS_KEYS = ("ns_coefficients", "ns_steps", "eps")
MOMENTUM = "momentum_buffer"
# Stages 1-3: how many all-to-alls bring the results back (fewer if no owner has that many
# batches). A few let Newton-Schulz of the next chunk hide the transfer of the last one; each
# more is one more collective call (latency) for a smaller share to hide.
DEFAULT_CHUNKS = 4


class MuonRuleState(RuleState):
    """The rule state of ``MuonRule``: no per-parameter scalars, and the owner plan."""

    def __init__(self, rule: UpdateRule, n: int, comm: Comm, table: ParamTable) -> None:
        super().__init__(rule, n)
        self.comm, self.table = comm, table
        self._key: Any = None
        self._plan: MuonPlan | None = None
        self._exchange: OwnerExchange | None = None
        self._shard: PipelinedShardExchange | None = None
        self._shard_layout: Layout | None = None
        self.chunks = DEFAULT_CHUNKS

    def set_chunks(self, chunks: int) -> None:
        """The exchange's schedule at stages 1-3, the same on every rank (each chunk is a
        collective): ``chunks >= 1`` overlaps it with the step (the owner-bound all-to-all
        with the weight decay and Newton-Schulz of the matrices the owner holds whole; the
        results back in up to ``chunks`` all-to-alls, each with Newton-Schulz of the next);
        0 runs it synchronously (two blocking all-to-alls). The results are the same bits.

        Args:
            chunks: an int >= 0 (default :data:`DEFAULT_CHUNKS`).

        Raises:
            ValueError: ``chunks`` is not an int >= 0.
        """
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 0:
            raise ValueError(f"chunks must be an int >= 0 (0: synchronous), got {chunks!r}")
        self.chunks = chunks

    @property
    def plan(self) -> MuonPlan:
        """The owner of every matrix, for the current parameters and group size."""
        key = (tuple(tuple(s) for s in self.table.shapes), self.comm.world_size)
        if key != self._key or self._plan is None:
            self._plan = plan_muon([tuple(s) for s in self.table.shapes], self.comm.world_size)
            self._key, self._exchange = key, None
        return self._plan

    def exchange(self, device: torch.device) -> OwnerExchange:
        """Stage 0's exchange: the owners' segments, gathered by every rank."""
        plan = self.plan
        if self._exchange is None or self._exchange.grad_buffer.device != device:
            # Gradients and momentum are fp32 (the state format is); NS returns bfloat16.
            self._exchange = OwnerExchange(plan, self.comm, torch.float32, torch.bfloat16,
                                           device)
        return self._exchange

    def shard_exchange(self, layout: Layout, device: torch.device
                       ) -> PipelinedShardExchange:
        """Stages 1-3's exchange: every rank's runs of the matrices, routed to and from
        their owners (the runs are gathered once per layout: a collective, on every rank
        at the same step since a layout changes on every rank at once)."""
        plan = self.plan
        if (self._shard is None or self._shard_layout is not layout
                or self._shard.plan is not plan or self._shard.device != device):
            mine = [ShardPiece(pc.param, pc.param_offset, pc.numel) for pc in layout.pieces
                    if pc.param >= 0]
            pieces = PipelinedShardExchange.gather_pieces(self.comm, mine)
            self._shard = PipelinedShardExchange(plan, self.comm, pieces, torch.float32,
                                                 torch.bfloat16, device)
            self._shard_layout = layout
        return self._shard

    def memory_stats(self, layout: Layout) -> dict[str, int]:
        """The exchange's buffers, kept between steps, for the parameters laid out as
        ``layout``: their bytes as allocated (stage 0: OwnerExchange's, stages 1-3:
        ShardExchange's), or before the step that allocates them what it will allocate
        (zerokern.formulas ``muon_exchange_memory_bytes``, from this rank's pieces alone:
        no collective, nothing allocated by asking)."""
        plan = self.plan  # first: a plan of other shapes drops its exchange
        ex: OwnerExchange | PipelinedShardExchange | None
        if layout.stage == 0:
            ex = self._exchange
        else:
            ex = self._shard
            if ex is not None and (self._shard_layout is not layout or ex.plan is not plan):
                ex = None  # the next step rebuilds it for this layout
        if ex is None:
            owned = list(plan.owned_numel)
            return muon_exchange_memory_bytes(owned, layout.stage,
                                              _held(plan, layout, self.comm.rank), self.comm.rank)
        # Every tensor the exchange holds, measured: a buffer added to it shows here.
        return {f"muon_{k.lstrip('_')}": _nbytes(t) for k, t in vars(ex).items()
                if torch.is_tensor(t)}

    def update(self, engine: Engine, runs: list[Run], groups: list[dict[str, Any]],
               grad_scale: float, active: list[bool]) -> None:
        del runs  # the pieces say where each matrix's elements are
        plan, layout = self.plan, engine.layout
        group_of = [gi for gi, n in enumerate(self.table.group_counts()) for _ in range(n)]
        momentum = engine.state.buffers[MOMENTUM].main.data
        rank, s = self.comm.rank, plan.segment_numel
        pieces = [pc for pc in layout.pieces if pc.param >= 0 and active[pc.param]]

        def updates() -> Iterator[torch.Tensor]:
            # The element-wise lines, one piece at a time (consumed as they are made).
            for pc in pieces:
                g = groups[group_of[pc.param]]
                grad = _cat(engine.grad_slices(pc.local_start, pc.numel)).float()
                if grad_scale != 1.0:
                    grad = grad / grad_scale
                buf = momentum.narrow(0, pc.local_start, pc.numel)
                buf.lerp_(grad, 1 - g["momentum"])
                yield grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf

        def decay(pc: Any) -> None:  # torch's param.mul_(1 - lr * weight_decay)
            g = groups[group_of[pc.param]]
            engine.values(pc.local_start, pc.numel).mul_(1 - float(g["lr"]) * g["weight_decay"])

        def apply(pc: Any, ortho: torch.Tensor) -> None:  # param.add_(update, alpha=-lr')
            g = groups[group_of[pc.param]]
            values = engine.values(pc.local_start, pc.numel)
            if ortho.device != values.device:  # offload: the master is on the host
                ortho = ortho.to(values.device)
            values.add_(ortho, alpha=-adjust_lr(float(g["lr"]), g["adjust_lr_fn"],
                                                plan.units[pc.param].shape))

        with torch.no_grad():
            if layout.stage >= 1 and self.chunks:
                self._pipelined(self.shard_exchange(layout, engine.device), updates(), pieces,
                                decay, apply, groups, group_of, active)
                engine.sync_params(gather=True)
                return
            if layout.stage >= 1:
                sx = self.shard_exchange(layout, engine.device)
                src = sx.to_owners(updates(), active)
                self._orthogonalize(src, sx.param_segment, groups, group_of, active)
                orthos = sx.from_owners(active)
            else:  # every rank holds every element: owners read theirs, all gather all
                ex = self.exchange(engine.device)
                src, dst = ex.segment(ex.grad_buffer), ex.segment(ex.param_buffer)
                for pc, update in zip(pieces, updates()):
                    u = plan.units[pc.param]
                    if u.owner == rank:
                        src.narrow(0, u.offset + pc.param_offset, pc.numel).copy_(update)
                self._orthogonalize(src, dst, groups, group_of, active)
                gathered = ex.gather_segments()
                orthos = [gathered.narrow(0, plan.units[pc.param].owner * s
                                          + plan.units[pc.param].offset + pc.param_offset,
                                          pc.numel) for pc in pieces]
            for pc, ortho in zip(pieces, orthos):
                decay(pc)
                apply(pc, ortho)
        engine.sync_params(gather=True)

    def _pipelined(self, sx: PipelinedShardExchange, updates: Iterator[torch.Tensor],
                   pieces: list[Any], decay: Any, apply: Any, groups: list[dict[str, Any]],
                   group_of: list[int], active: list[bool]) -> None:
        """Stages 1-3, overlapped (zerokern.comm.shard_pipeline): while the updates travel to
        their owners, every rank decays its own elements and the owner orthogonalizes the
        batches it holds whole; then, chunk by chunk, Newton-Schulz of the chunk, its results
        sent back, and the chunk before it applied while this one travels. Each element sees
        the same operations on the same values as in the synchronous schedule."""
        plan = self.plan
        chunks = min(self.chunks, max(1, max(len(b) for b in plan.batches)))
        pending = sx.start_to_owners(updates, active)
        for pc in pieces:
            decay(pc)
        sx.note("decay")
        early = sx.local_batches()
        held = set(early)
        self._orthogonalize(sx.grad_segment, sx.param_segment, groups, group_of, active,
                            early, sx.note)
        pending.wait()
        mine, _ = sx.chunk_batches(chunks)
        sent: list[Any] = []
        for c in range(chunks):
            self._orthogonalize(sx.grad_segment, sx.param_segment, groups, group_of, active,
                                [b for b in mine[c] if b not in held], sx.note)
            sent.append(sx.start_back(c, chunks, active))
            if c:
                for i, ortho in sent[c - 1].wait():
                    apply(pieces[i], ortho)
        for i, ortho in sent[-1].wait():
            apply(pieces[i], ortho)

    def _orthogonalize(self, src: torch.Tensor, dst: torch.Tensor,
                       groups: list[dict[str, Any]], group_of: list[int],
                       active: list[bool], which: list[int] | None = None,
                       note: Any = None) -> None:
        """NS of every matrix this rank owns that is stepped (of its batches ``which``, by
        index; default all), from its segment ``src`` (the updates) into its segment
        ``dst``: one batched NS per batch of same-shape matrices with the same NS settings.
        ``note("ns", index)`` before each batch, if given."""
        plan = self.plan
        mine = plan.batches[self.comm.rank]
        for bi in range(len(mine)) if which is None else which:
            b = mine[bi]
            if note is not None:
                note("ns", bi)
            units = [plan.units[k] for k in b.units]
            live = [u for u in units if active[u.matrix]]
            if not live:
                continue
            keys = {_ns_key(groups[group_of[u.matrix]]) for u in live}
            if len(live) == len(units) and len(keys) == 1:
                batch_view(dst, b).copy_(_ns(batch_view(src, b), next(iter(keys))))
                continue
            for u in live:
                one = segment_view(src, u).unsqueeze(0)
                segment_view(dst, u).copy_(_ns(one, _ns_key(groups[group_of[u.matrix]]))[0])


def _ns_key(g: dict[str, Any]) -> tuple[Any, ...]:
    return (tuple(g["ns_coefficients"]), int(g["ns_steps"]), float(g["eps"]))


def _ns(stack: torch.Tensor, key: tuple[Any, ...]) -> torch.Tensor:
    coeffs, steps, eps = key
    return newton_schulz(stack, coeffs, steps, eps, _addmm(None))


def _held(plan: MuonPlan, layout: Layout, rank: int) -> list[list[int]]:
    """The ``held`` table of zerokern.formulas ``muon_exchange_memory_bytes`` as far as this
    rank's bytes depend on it: its own row from its pieces; the rest of each column (what
    other ranks hold of an owner's matrices) lumped into one other rank's row, so each
    column still sums to the owner's elements."""
    n = plan.world_size
    held = [[0] * n for _ in range(n)]
    for pc in layout.pieces:
        if pc.param >= 0:
            held[rank][plan.units[pc.param].owner] += pc.numel
    if n > 1:
        other = (rank + 1) % n
        for o in range(n):
            held[other][o] = plan.owned_numel[o] - held[rank][o]
    return held


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
