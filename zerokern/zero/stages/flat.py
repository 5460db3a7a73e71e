"""What stages 0-2 share: every rank holds the full parameters in one flat buffer (the model's
parameters become views of it), gradients go through the bucket sequencer of grads.py, and
stages 1-2 gather each bucket's updated slice back in place.
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm import Comm, Handle
from ...memory.alias import own_storage
from ..grads import GradReducer
from ..layout import Layout
from .base import BufferSpec, Engine, Run, reserved_bytes


class FlatEngine(Engine):
    pool_size: int = 0  # constant-size bucket buffers (stage 2)

    def __init__(self, layout: Layout, params: list[torch.nn.Parameter], comm: Comm, *,
                 dtype: torch.dtype, device: torch.device, overlap: bool,
                 backend: str | None) -> None:
        super().__init__(layout, params, comm, dtype=dtype, device=device, overlap=overlap,
                         backend=backend)
        with torch.no_grad():
            self.flat_param = self.alloc("params", layout.flat_numel, dtype)
            for i, p in enumerate(params):
                view = self.flat_param.narrow(0, layout.param_flat_offset[i], p.numel())
                view.copy_(p.detach().reshape(-1))
                # A storage of the parameter's own bytes over the flat buffer: torch.save of
                # the model, its state_dict() or a parameter writes each tensor's bytes, not
                # the arena (memory/alias.py).
                p.data = own_storage(view).view_as(p)
            self.alloc_grads()
            self.alloc_state()
            self.init_master()
        self.overflow_bucket_bytes = 0
        self.pool_blocks: list[Any] = []
        self.reducer = GradReducer(layout, params, self, overlap=self.overlap, backend=backend,
                                   max_inflight=self.max_inflight())

    @classmethod
    def buffer_specs(cls, layout: Layout, dtype: torch.dtype) -> list[BufferSpec]:
        """Stages 0-1: the flat parameters, a full-size flat gradient, the state."""
        return [BufferSpec("params", layout.flat_numel, dtype),
                BufferSpec("grads", layout.flat_numel, dtype),
                *cls.state_specs(layout, dtype)]

    def alloc_grads(self) -> None:
        """The stage's gradient buffers: stages 0-1 a persistent full-size flat gradient (its
        buckets are what autograd accumulates into); stage 2 overrides this."""
        self.flat_grad = self.alloc("grads", self.layout.flat_numel, self.dtype)

    def max_inflight(self) -> int | None:
        return None

    # -- BucketOps (grads.py) defaults -----------------------------------------------------
    def after_delivery(self, index: int) -> None:
        # stage 0/1: from now on autograd accumulates straight into the flat gradient
        p = self.params[index]
        off = self.layout.param_flat_offset[index]
        p.grad = self.flat_grad.narrow(0, off, p.numel()).view_as(p)

    def keeps_earlier_rounds(self) -> bool:
        return True

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
        return self.reducer.got_grad

    def end_step(self) -> None:
        self.reducer.reset()

    def set_sync(self, value: bool) -> None:
        self.reducer.sync = value

    def zero_grad(self, set_to_none: bool) -> None:
        keep_views = not set_to_none  # stages 0-1 (stage 2 has its own zero_grad)
        for i, p in enumerate(self.params):
            if keep_views:
                off = self.layout.param_flat_offset[i]
                p.grad = self.flat_grad.narrow(0, off, p.numel()).view_as(p)
            else:
                p.grad = None
        if keep_views:
            self.flat_grad.zero_()
        self.reducer.drain()  # a backward that raised may have left collectives in flight
        self.reducer.reset(zeroed=True)

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

    def gather_buckets(self, runs: list[Run], update: Any, source: Any = None) -> None:
        """Stages 1-2: update this rank's slice bucket by bucket (``update(run_part)``) and
        start each bucket's all-gather as soon as its slice is final, so the gathers overlap
        the remaining updates (NCCL on its stream, gloo on its threads). Every rank gathers
        in bucket order, in place from its own slice of the flat parameters unless
        ``source(bucket)`` gives another one."""
        handles = []
        for bk in self.layout.buckets:
            lo, hi = bk.shard_start, bk.shard_start + bk.shard_numel
            for r in runs:
                a, b = max(r.start, lo), min(r.stop, hi)
                if a < b:
                    update(Run(r.group, a, b, r.step))
            full = self.flat_param.narrow(0, bk.flat_start, bk.numel)
            mine = (source(bk) if source is not None else
                    full.narrow(0, self.comm.rank * bk.shard_numel, bk.shard_numel))
            h = self.comm.all_gather(full, mine, f"parameters of bucket {bk.index}",
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
            self.gather_buckets([], lambda run: None)

    # -- accounting -------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        a = self.arena.stats()
        pool = sum(b.nbytes for b in self.pool_blocks)
        specs = type(self).buffer_specs(self.layout, self.dtype)
        return flat_memory(self.layout, self.dtype, specs,
                           buckets=pool + self.overflow_bucket_bytes,
                           overflow=self.overflow_bucket_bytes, scratch=self.comm.scratch_peak,
                           in_use=int(a["in_use"]), capacity=int(a["capacity"]))


def flat_memory(layout: Layout, dtype: torch.dtype, specs: list[BufferSpec], *, buckets: int,
                overflow: int, scratch: int, in_use: int, capacity: int) -> dict[str, int]:
    """Bytes a stage-0/1/2 rank holds for model states, by kind; padding (bucket and shard
    rounding) on its own. Also what memory_stats() reports before the first step, from the
    buffers the engine will allocate."""
    esz = torch.empty(0, dtype=dtype).element_size()
    psi = sum(layout.plans[g].total_numel for g in range(len(layout.plans)))
    local_real = sum(pc.numel for pc in layout.pieces if pc.param >= 0)
    kinds = {s.kind for s in specs}
    nstate = 3 if "master" in kinds else 2
    out = {"params": psi * esz, "grads": 0,
           "master": local_real * 4 if "master" in kinds else 0,
           "exp_avg": local_real * 4, "exp_avg_sq": local_real * 4, "buckets": buckets,
           "padding": (layout.local_numel - local_real) * 4 * nstate
           + (layout.flat_numel - psi) * esz}
    for s in specs:
        if s.kind != "grads":
            continue
        if s.numel == layout.flat_numel:  # the full flat gradient (stages 0-1)
            out["grads"] += psi * esz
            out["padding"] += (layout.flat_numel - psi) * esz
        else:  # the gradient shard (stage 2)
            out["grads"] += local_real * esz
            out["padding"] += (layout.local_numel - local_real) * esz
    # Receive buffers of gloo's point-to-point reduce-scatter (stage 1 in place; stage 2
    # with more than 2 ranks): the most held at once. 0 on NCCL.
    out["comm_scratch"] = scratch
    out["arena_in_use"] = in_use
    out["arena_capacity"] = capacity
    out["total"] = in_use + overflow + scratch
    out["device_total"] = out["total"]
    out["host_total"] = 0  # nothing offloaded
    return out


def planned_flat_memory(layout: Layout, dtype: torch.dtype,
                        specs: list[BufferSpec]) -> dict[str, int]:
    """memory_stats() before the first step: nothing is allocated yet; the buffers the
    engine will take, the bucket pool included."""
    nbytes = reserved_bytes(specs)
    pool = sum(s.numel * torch.empty(0, dtype=s.dtype).element_size()
               for s in specs if s.kind == "buckets")
    return flat_memory(layout, dtype, specs, buckets=pool, overflow=0, scratch=0,
                       in_use=nbytes, capacity=nbytes)
