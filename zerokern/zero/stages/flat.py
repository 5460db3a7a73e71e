"""What stages 0-2 share: every rank holds the full parameters in one flat buffer (the model's
parameters become views of it), gradients go through the bucket sequencer of grads.py, and
stages 1-2 gather each bucket's updated slice back in place.

The state (shard_state.py) sits on the device or, with ``offload``, on the host: the stage
asks it where a bucket's reduced gradient goes (``reduce_target`` / ``receive``), runs its
step bucket by bucket, and lets it put the new parameters in place before each bucket's
gather (``before_gather``). The same code serves both placements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...comm import Comm, Handle
from ...comm.parts import gather_part, reduce_part
from ...comm.quantized_parts import WireFormat
from ...memory.alias import own_storage
from ..grad_guard import GradGuard
from ..grads import GradReducer
from ..layout import Bucket, Layout
from ..placement import BufferSpec
from ..rules import UpdateRule
from ..shard_state import ShardState
from ..state_format import StateFormat
from .accounting import (
    flat_memory,
    offload_flat_memory,
    scratch_peak,
    slot_numel,
    state_buffers,
    with_residuals,
)
from .base import Engine, Run
from .pool import BucketPool


class FlatEngine(BucketPool, Engine):
    pool_size: int = 0  # constant-size bucket buffers (stage 2)
    shards_grads: bool = False  # stage 2: the state keeps the reduced gradient shard

    def __init__(self, layout: Layout, params: list[torch.nn.Parameter], comm: Comm, *,
                 dtype: torch.dtype, device: torch.device, overlap: bool,
                 backend: str | None, offload: bool = False, fmt: StateFormat | None = None,
                 seed: int = 0, param_numels: list[int] | None = None,
                 grad_dtype: torch.dtype | None = None, rule: UpdateRule | None = None,
                 wire: WireFormat | None = None) -> None:
        super().__init__(layout, params, comm, dtype=dtype, device=device, overlap=overlap,
                         backend=backend, offload=offload, fmt=fmt, seed=seed,
                         param_numels=param_numels, grad_dtype=grad_dtype, rule=rule)
        # Gradients reduced in another dtype than the parameters' (reduce_dtype): autograd's
        # buffers stay in the parameters' dtype, the reduction and the step's gradient are in
        # grad_dtype.
        self.cast = self.grad_dtype != dtype
        # How gradients are reduced and parameters gathered on this layout (comm/parts.py):
        # the stage calls their verbs, never a collective. ``wire``: quantized on the wire
        # (reduce_dtype / gather_dtype "int8", "int4": comm/quantized_parts.py).
        wire = wire or WireFormat()
        self.grad_comm = reduce_part(comm, self.grad_dtype, wire.reduce_bits, wire.feedback)
        self.param_comm = gather_part(comm, wire.gather_bits)
        self.hybrid = self.grad_comm.mesh.hybrid
        with torch.no_grad():
            self.flat_param = self.alloc("params", layout.flat_numel, dtype)
            for i, p in enumerate(params):
                view = self.flat_param.narrow(0, layout.param_flat_offset[i], p.numel())
                view.copy_(p.detach().reshape(-1))
                # A storage of the parameter's own bytes over the flat buffer: torch.save of
                # the model, its state_dict() or a parameter writes each tensor's bytes, not
                # the arena (memory/alias.py).
                p.data = own_storage(view).view_as(p)
            self.pool_blocks: list[Any] = []  # the bucket pool (alloc_grads)
            self.alloc_grads()
            master, own_grads = self.state_options(dtype, offload, self.fmt, self.grad_dtype)
            # With offload the host keeps an fp32 master for fp32 parameters too: the kernel
            # runs on the host copy, the device parameters receive the result.
            self.state = self.make_state(master=master, own_grads=own_grads,
                                         chunks=len(layout.buckets),
                                         slot_numel=slot_numel(layout))
            self.init_master()
        self.overflow_bucket_bytes = 0
        self._reducing: dict[int, tuple[torch.Tensor, bool, torch.Tensor | None]] = {}
        self.reducer = GradReducer(layout, params, self, overlap=self.overlap, backend=backend,
                                   max_inflight=self.max_inflight())

    # -- buffers ----------------------------------------------------------------------------
    @classmethod
    def cast_shards_grads(cls) -> bool:
        """Whether, with gradients reduced in another dtype, the state keeps the reduced
        gradient shard (stage 1: its flat gradient is autograd's, in the parameters' dtype)."""
        return cls.shards_grads

    @classmethod
    def state_options(cls, dtype: torch.dtype, offload: bool,
                      fmt: StateFormat | None = None,
                      grad_dtype: torch.dtype | None = None) -> tuple[bool, bool]:
        """(master, own_grads) of this stage's state. ``master="none"``: the parameters are
        updated in place, except that an offloaded state keeps their bf16 copy on the host."""
        shards = cls.cast_shards_grads() if grad_dtype not in (None, dtype) else cls.shards_grads
        if fmt is not None and fmt.in_place:
            return offload, offload or shards
        return offload or dtype != torch.float32, offload or shards

    @classmethod
    def stage_specs(cls, layout: Layout, dtype: torch.dtype,
                    grad_dtype: torch.dtype | None = None) -> list[BufferSpec]:
        """What the stage itself keeps on the device; stages 0-1: the flat parameters and a
        full-size flat gradient (its buckets are what autograd accumulates into)."""
        return [BufferSpec("params", layout.flat_numel, dtype),
                BufferSpec("grads", layout.flat_numel, dtype)]

    @classmethod
    def device_specs(cls, layout: Layout, dtype: torch.dtype, offload: bool,
                     fmt: StateFormat | None = None, side_numel: int = 0,
                     grad_dtype: torch.dtype | None = None,
                     rule: UpdateRule | None = None) -> list[BufferSpec]:
        gdt = grad_dtype or dtype
        specs = cls.stage_specs(layout, dtype, gdt)
        if not offload:
            master, own_grads = cls.state_options(dtype, offload, fmt, gdt)
            specs += ShardState.specs(layout.local_numel, gdt, master=master,
                                      own_grads=own_grads, fmt=fmt, side_numel=side_numel,
                                      rule=rule)
        return specs

    @classmethod
    def host_specs(cls, layout: Layout, dtype: torch.dtype, fmt: StateFormat | None = None,
                   side_numel: int = 0, rule: UpdateRule | None = None) -> list[BufferSpec]:
        """The host arena's blocks with offload: the state and two staging slots."""
        master, own_grads = cls.state_options(dtype, True, fmt)
        return [*ShardState.specs(layout.local_numel, dtype, master=master,
                                  own_grads=own_grads, fmt=fmt, side_numel=side_numel,
                                  rule=rule),
                *[BufferSpec("staging", slot_numel(layout), dtype)] * 2]

    def alloc_grads(self) -> None:
        self.flat_grad: torch.Tensor | None = self.alloc("grads", self.layout.flat_numel,
                                                         self.dtype)

    def bucket_label(self, b: int) -> str:
        bk = self.layout.buckets[b]
        return f"bucket {b} (group {bk.group}, {bk.numel} elements)"

    def max_inflight(self) -> int | None:
        return None

    def own(self, b: int, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of bucket ``b``'s tensor ``t``."""
        bk = self.layout.buckets[b]
        return t.narrow(0, self.comm.rank * bk.shard_numel, bk.shard_numel)

    def grad_of(self, ls: int, fs: int, k: int) -> torch.Tensor:
        """The averaged gradient the step reads for local range [ls, ls + k) (flat [fs,
        fs + k)): the state's shard, or this rank's slice of the flat gradient."""
        if self.state.grads is not None:
            return self.state.grads.narrow(0, ls, k)
        assert self.flat_grad is not None
        return self.flat_grad.narrow(0, fs, k)

    # -- BucketOps (grads.py) defaults -----------------------------------------------------
    def after_delivery(self, index: int) -> None:
        # stage 0/1: from now on autograd accumulates straight into the flat gradient
        p = self.params[index]
        off = self.layout.param_flat_offset[index]
        p.grad = self.flat_grad.narrow(0, off, p.numel()).view_as(p)

    def keeps_earlier_rounds(self) -> bool:
        return True

    def settle(self) -> None:
        self.grad_comm.settle()

    def bucket_tensor(self, b: int) -> torch.Tensor:
        bk = self.layout.buckets[b]
        return self.flat_grad.narrow(0, bk.flat_start, bk.numel)

    def start_reduce(self, b: int, src: torch.Tensor, accumulate: bool) -> Handle | None:
        raise NotImplementedError

    def finish_reduce(self, b: int, src: torch.Tensor) -> None:
        raise NotImplementedError

    # -- the step -----------------------------------------------------------------------------
    def on_grad(self, index: int) -> None:
        self.reducer.on_grad_ready(index)

    def finish_grads(self) -> list[bool]:
        self.reducer.flush()
        self.state.drain()  # every landed gradient is in the state's shard
        return self.reducer.got_grad

    def grad_slices(self, start: int, numel: int) -> list[torch.Tensor]:
        if self.state.grads is not None:
            return [self.state.grads.narrow(0, start, numel)]
        return [self.flat_grad.narrow(0, fs, k)
                for _, fs, k in self.flat_slices(start, start + numel)]

    def end_step(self) -> None:
        self.reducer.reset()
        super().end_step()

    def has_grad(self, index: int) -> bool:
        return self.reducer.got_grad[index]

    def drop_grad(self, index: int) -> None:
        self.reducer.drain()  # nothing lands in the buffers while they are zeroed
        self.state.drain()
        for b, boff, _, n in self.reducer.frags[index]:
            if self.flat_grad is not None:
                # Stages 0-1: autograd's flat gradient holds every round's part of the step.
                self.flat_grad.narrow(0, self.layout.buckets[b].flat_start + boff, n).zero_()
            elif b in self.buffers:  # stage 2: a bucket still filling in the pool
                self.buffers[b].narrow(0, boff, n).zero_()
        self._zero_reduced(index)  # the reduced rounds (stage 2, reduce dtype, offload)
        self.reducer.got_grad[index] = False

    def set_sync(self, value: bool) -> None:
        self.reducer.sync = value

    def zero_grad(self, set_to_none: bool, keep: list[bool] | None = None) -> None:
        keep_views = not set_to_none  # stages 0-1 (stage 2 has its own zero_grad)
        for i, p in enumerate(self.params):
            # torch zeroes the gradients that exist and leaves the others None.
            if keep_views and (keep is None or keep[i]):
                off = self.layout.param_flat_offset[i]
                p.grad = self.flat_grad.narrow(0, off, p.numel()).view_as(p)
            else:
                p.grad = None
        if keep_views:
            self.flat_grad.zero_()
        self.reducer.drain()  # a backward that raised may have left collectives in flight
        self.reducer.reset(zeroed=True)

    def adopt_grads(self, old: FlatEngine, count: int) -> None:
        """After add_param_group re-laid the buffers out (stages 0-1: they hold .grad): the
        first ``count`` parameters' gradients (views of ``old``'s flat gradient: zeros kept
        by zero_grad(set_to_none=False), or the last step's, not zeroed yet) move into this
        engine's, as views again, and the reducer remembers whether they were zeroed."""
        self.reducer.zeroed = old.reducer.zeroed
        if self.flat_grad is None:
            return
        for i in range(count):
            p = self.params[i]
            stale = p.grad if isinstance(p.grad, GradGuard) else None
            g = p.grad if stale is None else stale.zk_held  # a stale guard holds the view
            if g is None or isinstance(g, GradGuard):
                continue
            view = self.flat_grad.narrow(0, self.layout.param_flat_offset[i],
                                         p.numel()).view_as(p)
            view.copy_(g)
            if stale is None:
                p.grad = view
            else:
                stale.zk_held = view

    def flat_slices(self, s: int, e: int) -> list[tuple[int, int, int]]:
        """(local start, flat start, numel) of local range [s, e) in stages 1-2: this rank's
        slice of each bucket sits at flat_start + rank * shard_numel."""
        out = []
        r = self.comm.rank
        for bk in self.layout.buckets:
            lo, hi = max(s, bk.shard_start), min(e, bk.shard_start + bk.shard_numel)
            if lo < hi:
                out.append((lo, bk.flat_start + r * bk.shard_numel + lo - bk.shard_start,
                            hi - lo))
        return out

    def step_into_params(self, run: Run, bk: Bucket, groups: list[dict[str, Any]],
                         grad_scale: float) -> None:
        """The step of ``run`` (within bucket ``bk``), the new parameters written into this
        rank's slice of the flat parameters (the source of the bucket's in-place gather)."""
        for ls, fs, k in self.flat_slices(run.start, run.stop):
            self.state.step(bk.index, groups[run.group], ls, k, run.step, grad_scale,
                            grad=self.grad_of(ls, fs, k), param=self.flat_param.narrow(0, fs, k))

    def params_source(self, bk: Bucket) -> torch.Tensor:
        """The gather's source when the step wrote into the flat parameters: this rank's
        slice of them, once the state's copies back have reached it."""
        self.state.before_gather(bk.index)
        return self.own(bk.index, self.flat_param.narrow(0, bk.flat_start, bk.numel))

    def gather_buckets(self, runs: list[Run], update: Callable[[Run, Bucket], None],
                       source: Callable[[Bucket], torch.Tensor]) -> None:
        """Stages 1-2: update this rank's slice bucket by bucket (``update(run_part,
        bucket)``) and start each bucket's all-gather as soon as its slice is final, so the
        gathers overlap the remaining updates (NCCL on its stream, gloo on its threads).
        Every rank gathers in bucket order, in place from ``source(bucket)``."""
        handles = []
        for bk in self.layout.buckets:
            lo, hi = bk.shard_start, bk.shard_start + bk.shard_numel
            for r in runs:
                a, b = max(r.start, lo), min(r.stop, hi)
                if a < b:
                    update(Run(r.group, a, b, r.step), bk)
            full = self.flat_param.narrow(0, bk.flat_start, bk.numel)
            h = self.param_comm.gather(full, source(bk), f"parameters of bucket {bk.index}",
                                       async_op=self.overlap)
            if h is not None:
                handles.append(h)
        for h in handles:
            h.wait()

    # -- sharded state ----------------------------------------------------------------------
    def values(self, start: int, numel: int) -> torch.Tensor:
        if self.master is not None:
            return self.master.narrow(0, start, numel)
        (ls, fs, k), = self.flat_slices(start, start + numel)
        return self.flat_param.narrow(0, fs, k)

    def init_master(self) -> None:
        if self.master is None:
            return
        for ls, fs, k in self.flat_slices(0, self.layout.local_numel):
            self.master.narrow(0, ls, k).copy_(self.flat_param.narrow(0, fs, k))

    def sync_params(self, gather: bool) -> None:
        if self.master is not None:
            for ls, fs, k in self.flat_slices(0, self.layout.local_numel):
                self.flat_param.narrow(0, fs, k).copy_(self.master.narrow(0, ls, k))
        if gather:
            self.gather_buckets([], lambda run, bk: None,
                                lambda bk: self.own(bk.index, self.flat_param.narrow(
                                    0, bk.flat_start, bk.numel)))

    # -- accounting -------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        a = self.arena.stats()
        pool = sum(b.nbytes for b in self.pool_blocks) + self.overflow_bucket_bytes
        specs = type(self).device_specs(self.layout, self.dtype, self.offload, self.fmt,
                                        self.side_numel, self.grad_dtype, self.rule)
        # The state's kinds from its buffers as allocated (on the device or on the host).
        state = state_buffers(self.state)
        kw = dict(buckets=pool, overflow=self.overflow_bucket_bytes,
                  scratch=scratch_peak(self.comm), in_use=int(a["in_use"]),
                  capacity=int(a["capacity"]))
        h = self.state.placement.memory()  # its own arena: none on the device
        if not h:
            return with_residuals(flat_memory(self.layout, self.dtype, specs, state, **kw),
                                  self.grad_comm)
        return offload_flat_memory(self.layout, self.dtype, specs, state, **kw,
                                   host_in_use=h["in_use"], host_capacity=h["capacity"])
