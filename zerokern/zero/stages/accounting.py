"""memory_stats() of every stage, by kind and by side (device / host), from the layout and the
arenas' own accounting: the numbers the paper's formulas are checked against. Also what
memory_stats() reports before the first step, from the blocks the engine will take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..layout import Layout
from ..shard_state import BufferSpec
from .base import reserved_bytes

if TYPE_CHECKING:
    from ..stage3.runtime import Stage3Runtime


def _esize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def slot_numel(layout: Layout) -> int:
    """Elements of a staging slot at stages 1-2: the largest bucket shard."""
    return max((b.shard_numel for b in layout.buckets), default=1)


def flat_memory(layout: Layout, dtype: torch.dtype, specs: list[BufferSpec], *, buckets: int,
                overflow: int, scratch: int, in_use: int, capacity: int) -> dict[str, int]:
    """Bytes a stage-0/1/2 rank holds for model states, by kind; padding (bucket and shard
    rounding) on its own."""
    esz = _esize(dtype)
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


def offload_flat_memory(layout: Layout, dtype: torch.dtype, specs: list[BufferSpec], *,
                        buckets: int, overflow: int, scratch: int, in_use: int, capacity: int,
                        host_in_use: int, host_capacity: int) -> dict[str, int]:
    """Stages 1-2 with offload, by kind and by side. Device: the flat parameters (2Ψ), stage
    1's full-size gradient (2Ψ), stage 2's bucket pool. Host: master and moments (12Ψ/N),
    the gradient shard (2Ψ/N for 16-bit) and two staging slots."""
    esz = _esize(dtype)
    psi = sum(p.total_numel for p in layout.plans)
    local_real = sum(pc.numel for pc in layout.pieces if pc.param >= 0)
    full_grad = any(s.kind == "grads" for s in specs)
    slot = slot_numel(layout)
    pad_local = layout.local_numel - local_real
    out = {"params": psi * esz, "grads": psi * esz if full_grad else 0,
           "master": 0, "exp_avg": 0, "exp_avg_sq": 0, "buckets": buckets,
           "padding": (layout.flat_numel - psi) * esz * (2 if full_grad else 1),
           "comm_scratch": scratch, "arena_in_use": in_use, "arena_capacity": capacity,
           "total": in_use + overflow + scratch}
    out.update(host_memory(local_real, pad_local, esz, 2 * slot * esz, host_in_use,
                           host_capacity))
    out["device_total"] = out["total"]
    return out


def host_memory(local_real: int, pad_local: int, esz: int, staging: int, in_use: int,
                capacity: int, params: int = 0) -> dict[str, int]:
    """The host side of memory_stats() with offload (``params``: stage 3's offloaded
    parameter shard, in bytes)."""
    return {"host_master": 4 * local_real, "host_exp_avg": 4 * local_real,
            "host_exp_avg_sq": 4 * local_real, "host_grads": esz * local_real,
            "host_params": params, "host_staging": staging,
            "host_padding": pad_local * (12 + esz),
            "host_arena_in_use": in_use, "host_arena_capacity": capacity, "host_total": in_use}


def planned_flat_memory(layout: Layout, dtype: torch.dtype, specs: list[BufferSpec],
                        host_specs: list[BufferSpec] | None = None) -> dict[str, int]:
    """memory_stats() of stages 0-2 before the first step: nothing is allocated yet; the
    blocks the engine will take (``host_specs``: its host arena, with offload), the bucket
    pool included."""
    nbytes = reserved_bytes(specs)
    pool = sum(s.numel * _esize(s.dtype) for s in specs if s.kind == "buckets")
    if host_specs is None:
        return flat_memory(layout, dtype, specs, buckets=pool, overflow=0, scratch=0,
                           in_use=nbytes, capacity=nbytes)
    host = reserved_bytes(host_specs)
    return offload_flat_memory(layout, dtype, specs, buckets=pool, overflow=0, scratch=0,
                               in_use=nbytes, capacity=nbytes, host_in_use=host,
                               host_capacity=host)


def _gather_stats(rt: Stage3Runtime) -> dict[str, int]:
    g = rt.memory_stats()
    return {f"gather_{k}" if not k.startswith("gather") else k: v
            for k, v in g.items() if not k.startswith("local")}


def stage3_memory(layout: Layout, rt: Stage3Runtime, dtype: torch.dtype, *, master: bool,
                  arena_in_use: int) -> dict[str, int]:
    """Stage 3 with its state on the device: this rank's parameter and gradient slices
    (frozen parameters' included), master and moments of the trained ones, the gather
    arena."""
    L, esz = layout, _esize(dtype)
    local_real = sum(pc.numel for pc in L.pieces if pc.param >= 0)
    nstate = 3 if master else 2
    held = sum(pc.numel for pc in L.pieces)  # this rank's slice, frozen params too
    out = {"params": held * esz, "grads": held * esz,
           "master": local_real * 4 if master else 0,
           "exp_avg": local_real * 4, "exp_avg_sq": local_real * 4, "buckets": 0,
           "padding": (L.local_numel - local_real) * 4 * nstate
           + 2 * (rt.local_numel - held) * esz}
    out.update(_gather_stats(rt))
    out["total"] = 2 * rt.local_numel * esz + arena_in_use
    out["device_total"] = out["total"]
    out["host_total"] = 0  # nothing offloaded
    return out


def stage3_offload_memory(layout: Layout, rt: Stage3Runtime, dtype: torch.dtype, *,
                          master: bool, arena_in_use: int, slot: int, host_in_use: int,
                          host_capacity: int) -> dict[str, int]:
    """Stage 3 with ZeRO-Offload: on the device only the gathered units and (without
    offload_params) this rank's parameter slice; on the host the state, the gradient slice
    (the runtime's host arena) and, with offload_params, the parameter slice."""
    L, esz = layout, _esize(dtype)
    local_real = sum(pc.numel for pc in L.pieces if pc.param >= 0)
    held = sum(pc.numel for pc in L.pieces)
    on_host = rt.offload_params
    dev_params = 0 if on_host else rt.local_numel * esz
    out = {"params": 0 if on_host else held * esz, "grads": 0, "master": 0,
           "exp_avg": 0, "exp_avg_sq": 0, "buckets": 0,
           "padding": 0 if on_host else (rt.local_numel - held) * esz}
    out.update(_gather_stats(rt))
    out["total"] = dev_params + arena_in_use
    out["device_total"] = out["total"]
    rt_host = int(rt.grad_arena.stats()["in_use"])
    rt_cap = int(rt.grad_arena.stats()["capacity"])
    if on_host:
        rt_host += int(rt.param_arena.stats()["in_use"])
        rt_cap += int(rt.param_arena.stats()["capacity"])
    out.update({
        "host_master": local_real * 4 if master else 0, "host_exp_avg": local_real * 4,
        "host_exp_avg_sq": local_real * 4, "host_grads": held * esz,
        "host_params": held * esz if on_host else 0,
        "host_staging": 2 * slot * esz,
        "host_padding": (L.local_numel - local_real) * (8 + (4 if master else 0))
        + (rt.local_numel - held) * esz * (2 if on_host else 1),
        "host_arena_in_use": host_in_use + rt_host,
        "host_arena_capacity": host_capacity + rt_cap,
        "host_total": host_in_use + rt_host,
    })
    return out
