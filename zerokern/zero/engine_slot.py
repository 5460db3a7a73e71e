"""The stage engine a ZeroAdamW steps, the flat layout it was built for, and what it last
wrote into the parameters.

Stages 0-2 lay the parameters out at the first ``step()``, in the order in which the first
backward produced their gradients (as DDP rebuilds its buckets after one iteration), so
buckets fill front to back and never wait on a late or unused parameter; until then this
part only learns that order. Stage 3's units fix the layout at construction.
``add_param_group`` re-lays the buffers out with the new group appended and carries the
existing state over. The engine is reached through ``engines.make_engine`` and
``engines.planned_memory`` only.

Parameters written from outside (``model.load_state_dict``, ``p.copy_``, ``p.data = t``) are
what torch's AdamW trains from at its next step; the fp32 master here would overwrite them.
So this part remembers the parameters' versions as the engine left them and, when they
changed, hands the new values to the engine (rebind.py adopts replaced tensors).
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Comm
from ..comm.quantized_parts import WireFormat
from ..quant.maps import BLOCK
from . import rebind
from .engines import make_engine, planned_memory
from .layout import (
    ALIGN_ELEMS,
    STATE_ALIGN_ELEMS,
    Layout,
    build_layout,
    build_stage3_layout,
)
from .param_table import ParamTable
from .rules import ADAMW, UpdateRule
from .shard_state import ShardState
from .stage3 import owners
from .stages import Engine
from .state_format import StateFormat
from .stored import STORED_PARTS
from .validate import check_gather_dtype_params, check_master_dtype, common_dtype_device


class EngineSlot:
    """Holds the engine once laid out (``engine`` and ``layout`` are None before).

    Attributes:
        layout: the flat layout, or None until the first step (stages 0-2).
        engine: the stage's engine for ``layout``, or None.
        sync: False inside ``no_sync()``: gradients accumulate locally.
        dtype, device: the trained parameters' (stages 0-2: where they are when laid out).
    """

    def __init__(self, table: ParamTable, comm: Comm, *, stage: int, offload: str | None,
                 runtime: Any, bucket_numel: int | None, overlap: bool, backend: str | None,
                 dtype: torch.dtype, device: torch.device, fmt: StateFormat | None = None,
                 seed: int = 0, reduce_dtype: torch.dtype | str | None = None,
                 rule: UpdateRule | None = None, wire: WireFormat | None = None) -> None:
        self.table, self.comm, self.rt = table, comm, runtime
        self.rule = rule or ADAMW  # the update rule the engine's state is stepped with
        # ZeroAdamW(reduce_dtype=): None, torch.float32, or "int8" / "int4" (quantized on the
        # wire: the gradients stay in the parameters' dtype, wire below).
        self.reduce_dtype = reduce_dtype
        self.wire = wire or WireFormat()
        self.fmt, self.seed = fmt or StateFormat(), seed
        self.stage, self.offload, self.backend = stage, offload, backend
        self.bucket_numel, self.overlap = bucket_numel, overlap
        self.dtype, self.device = dtype, device
        self.layout: Layout | None = None
        self.engine: Engine | None = None
        self.sync = True
        self._observed: list[int] = []  # gradient order of the first backward (stages 0-2)
        self._seen: set[int] = set()
        self._versions: tuple[int, ...] | None = None  # parameters as the engine left them
        if self.rt is not None:
            owners.register_slot(self.rt, self)

    # -- the layout and the engine ----------------------------------------------------------
    def build(self, param_groups: list[dict[str, Any]],
              ready_order: list[int] | None = None) -> Layout:
        """Fix the layout (stages 0-2: in ``ready_order``, default reverse registration) and
        let the stage's engine allocate its buffers for it; nothing if already done."""
        if self.layout is not None:
            return self.layout
        params = self.table.params
        if self.rt is not None:
            # A compact state (the optimizer's own elements only) unless offloaded: the host
            # pipeline stages and lands gradients by slice (one optimizer per model there).
            align = None if self.offload else self.fmt.layout_alignment(STATE_ALIGN_ELEMS)
            layout = build_stage3_layout(self.rt, params, param_groups, align)
        else:
            # Where the parameters are now: a model moved after ZeroAdamW was built (as
            # Accelerate's prepare does, and the HF Trainer with optimizers=) trains there,
            # as torch's AdamW would; nothing was allocated for the old place.
            self.dtype, self.device = common_dtype_device(params)
            check_master_dtype(self.fmt, self.dtype)
            check_gather_dtype_params(self.wire.gather_bits, self.stage, self.dtype)
            layout = self._flat_layout(ready_order)
        self.engine = make_engine(
            self.stage, self.offload, layout, params, self.comm, dtype=self.dtype,
            device=self.device, overlap=self.overlap, backend=self.backend, runtime=self.rt,
            fmt=self.fmt, seed=self.seed, param_numels=self.param_numels,
            grad_dtype=self.grad_dtype, rule=self.rule, wire=self.wire)
        self.engine.set_sync(self.sync)
        self.layout = layout
        self.mark_params()
        return layout

    def build_at_first_step(self, param_groups: list[dict[str, Any]]) -> None:
        """Agree on rank 0's observed order, lay everything out, then push the gradients the
        first backward left on the parameters through the buckets in that order."""
        order = self.comm.all_gather_object(self._observed, "bucket order")[0]
        self.build(param_groups, order)
        for i in self.layout.ready_order:
            if self.table.params[i].grad is not None:
                self.engine.reducer.on_grad_ready(i, in_backward=False)

    def relayout(self, param_groups: list[dict[str, Any]], first_new: int) -> None:
        """add_param_group: the parameters from ``first_new`` on were appended to the table.
        Once laid out, the buffers are laid out again with them at the end; the existing
        groups keep their local space (a prefix of the new one; stage 3: the same space), so
        their state is copied over unchanged, and so are their gradients; the new ones'
        ``.grad`` (accumulated while they were in no optimizer) is left for the next step to
        reduce, as torch's AdamW steps with it."""
        old = self.engine
        if old is None:
            return  # laid out at the first step, with the new group in it
        order = list(self.layout.ready_order) + list(range(first_new, len(self.table.params)))
        self.layout, self.engine = None, None
        self.build(param_groups, order)
        with torch.no_grad():
            _carry_state(old.state, self.engine.state, old.layout, self.layout)
            if self.rt is None:
                self.engine.adopt_grads(old, first_new)

    def memory_stats(self) -> dict[str, int]:
        """The engine's, or before it exists (stages 0-2) what it will allocate, laid out in
        reverse registration order (nothing is fixed by asking)."""
        if self.engine is not None:
            return self.engine.memory_stats()
        L = self._flat_layout(None)
        return planned_memory(self.stage, self.offload, L, self.dtype, self.fmt,
                              self.param_numels, self.grad_dtype, self.rule)

    def planned_layout(self, param_groups: list[dict[str, Any]]) -> Layout:
        """The layout, or before it is fixed the one the first step would fix without an
        observed order (reverse registration; nothing is fixed by asking)."""
        if self.layout is not None:
            return self.layout
        if self.rt is not None:
            return build_stage3_layout(self.rt, self.table.params, param_groups)
        return self._flat_layout(None)

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in: ``reduce_dtype``, else the parameters'."""
        if self.rt is not None:
            return self.rt.grad_dtype
        if isinstance(self.reduce_dtype, torch.dtype):
            return self.reduce_dtype
        return self.dtype

    @property
    def param_numels(self) -> list[int]:
        """Every trained parameter's full element count (stage 3's are released)."""
        return [int(torch.Size(s).numel()) for s in self.table.shapes]

    def _flat_layout(self, ready_order: list[int] | None) -> Layout:
        """Stages 0-2's layout; int8 moments start each quantized parameter on a block."""
        return build_layout(
            self.table.group_sizes, stage=self.stage, world_size=self.comm.world_size,
            rank=self.comm.rank, bucket_numel=self.bucket_numel, ready_order=ready_order,
            alignment=self.fmt.layout_alignment(ALIGN_ELEMS),
            param_align=self.fmt.param_align(self.param_numels))

    # -- gradients in -----------------------------------------------------------------------
    def set_sync(self, value: bool) -> None:
        self.sync = value
        if self.engine is not None:
            self.engine.set_sync(value)

    def on_grad(self, index: int) -> None:
        """Stages 0-2, from autograd: parameter ``index`` got its gradient."""
        g = self.table.params[index].grad
        if g is not None and g.layout != torch.strided:
            raise TypeError(
                f"ZeroAdamW: parameter {index} got a {g.layout} gradient; sparse gradients "
                "are not supported (build nn.Embedding / EmbeddingBag with sparse=False)")
        if self.engine is not None:
            rebind.check_grad_param(self.table, index, self.dtype, self.device)
            self.engine.on_grad(index)
        elif index not in self._seen:  # before the layout exists: learn the ready order
            self._seen.add(index)
            self._observed.append(index)

    def deliver_unseen_grads(self) -> None:
        """Gradients on the parameters that no autograd hook delivered in this step (set by
        hand, left by no_sync backwards, or zeros kept by zero_grad(set_to_none=False)) are
        used, as torch's AdamW uses whatever .grad holds (stage 3: its runtime does this)."""
        if self.rt is not None or not self.sync:
            return
        red = self.engine.reducer
        for i, p in enumerate(self.table.params):
            if p.grad is not None and not red.got_grad[i]:
                if p.grad.layout != torch.strided:
                    raise TypeError(f"ZeroAdamW: parameter {i} has a {p.grad.layout} "
                                    "gradient; sparse gradients are not supported")
                red.on_grad_ready(i, in_backward=False)

    def has_pending_grads(self) -> bool:
        """Stages 0-2: gradients of this step already in the buckets."""
        return self.engine is not None and self.rt is None and any(self.engine.reducer.got_grad)

    # -- parameters written from outside ----------------------------------------------------
    def _param_versions(self) -> tuple[int, ...]:
        # Stage 3: the shard store itself (model.load_state_dict's hook writes into it);
        # stages 0-2: each parameter (its in-place writes, e.g. load_state_dict's copy_, bump
        # its own counter; ZeroAdamW writes the flat buffer underneath, which does not).
        if self.rt is not None:
            return (self.rt.local_params._version,)
        return tuple(p._version for p in self.table.params)

    def mark_params(self, wrote: bool = False) -> None:
        """Remember the parameters' versions: the engine has just written them (or its master
        agrees with them). ``wrote``: this optimizer wrote them, up to date before: at stage
        3 the other optimizers of the model that were so are still (stage3/owners.py)."""
        before = self._versions
        self._versions = self._param_versions() if self.engine is not None else None
        if wrote and self.rt is not None and before is not None:
            owners.advance_peers(self.rt, self, before, self._versions)

    def adopt_param_writes(self) -> None:
        """torch's AdamW reads its parameters at every step, so weights written into the
        model after construction (model.load_state_dict, p.copy_) are what it trains from.
        The fp32 master (16-bit parameters; with offload, every parameter) would overwrite
        them at the next step: when the parameters changed since the engine last wrote them,
        the master takes them."""
        if self.engine is None or self._versions is None:
            return
        # `p.data = t` since: t is adopted (its master too); a cast or move is refused.
        with torch.no_grad():
            if self.rt is not None:
                rebind.adopt_stage3(self.rt, self.table, self.engine, self.layout)
            else:
                rebind.adopt_flat(self.table, self.engine, self.layout, self.dtype,
                                  self.device)
        if self._param_versions() != self._versions:
            with torch.no_grad():
                self.engine.init_master()
            self.mark_params()


def _carry_state(old: ShardState, new: ShardState, old_layout: Layout,
                 new_layout: Layout) -> None:
    """add_param_group: ``old``'s state into ``new``, laid out for the same parameters plus
    the new group's. The old local space is a prefix of the new one (stage 3 without a compact
    state: the same space, the new parameters' pieces were holes), so the master, the rule's
    buffers and the int8 blocks' absmax (one per 256 local elements) keep their offsets. A
    compact stage-3 state maps each old segment to its place in the new one (the new holes are
    among the old ones, so an old segment lies in one new segment, at the same offset modulo
    the alignment: blocks stay blocks). The fp32 side buffers of small parameters are packed
    in local order, so a new small parameter placed before an old one shifts the old one's
    side offset. Those are copied run by run, at the offsets of the new plan."""
    segs = old_layout.segments if old_layout.compact else ((0, 0, old.numel),)
    moved = [(ls, new_layout.to_local(ss), n)
             for ls, ss, n in segs if n]

    def at_new(start: int) -> int:  # a run's old local start, in the new local space
        for ls, nls, n in moved:
            if ls <= start < ls + n:
                return nls + start - ls
        raise AssertionError(f"old local element {start} is in no segment")

    pairs = [(old.master, new.master, False)]
    for name, b in old.buffers.items():
        pairs += [(b.part(p), new.buffers[name].part(p), p == "absmax") for p in STORED_PARTS]
    for src, dst, per_block in pairs:
        if src is None:
            continue
        assert dst is not None
        if not per_block:
            for ls, nls, n in moved:
                dst.narrow(0, nls, n).copy_(src.narrow(0, ls, n))
        else:  # one scale per 256-element block: the blocks each segment touches
            for ls, nls, n in moved:
                a, b = ls // BLOCK, _blocks(ls + n)
                dst.narrow(0, nls // BLOCK, b - a).copy_(src.narrow(0, a, b - a))
    if old.runs is None or not old.side_numel:
        return
    for r in old.runs.runs:
        if r.side_start < 0:
            continue
        start = at_new(r.local_start)
        for nr, o, n in new.runs_in(start, start + r.numel):
            at = r.side_start + nr.local_start + o - start
            for name, b in old.buffers.items():
                dst, src = new.buffers[name].side, b.side
                assert dst is not None and src is not None
                dst.data.narrow(0, nr.side_start + o, n).copy_(src.data.narrow(0, at, n))


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)
