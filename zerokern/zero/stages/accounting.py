"""memory_stats() of every stage, by kind and by side (device / host), from the layout and the
arenas' own accounting: the numbers the paper's formulas are checked against. Also what
memory_stats() reports before the first step, from the blocks the engine will take.

The optimizer state's kinds are read from its buffers as allocated (or, before the first step,
from the specs the engine will allocate them from), so a compressed format (issue 27) reports
what it stores, never the 4 bytes an element of fp32 state would take. The kinds are the
update rule's (``state_kinds``; AdamW's buffers are its two moments, ``exp_avg`` first):

* ``master`` and each buffer (``exp_avg``): one slot per element of this rank's local space,
  in the buffer's own dtype (fp32 master or, for master="none" under offload, the bf16 host
  copy; fp32, bf16 or uint8 codes). The slots of trained elements are the kind's bytes; the
  others (shard and alignment padding, stage 3's frozen parameters) count as ``padding``.
* ``<buffer>_absmax`` (int8): the fp32 scales, one per 256-element block of the local space,
  all of the buffer.
* ``<buffer>_side`` (compressed formats): the fp32 values of parameters too small to compress
  (fewer than 4,096 elements), all of the buffer. The same elements keep their (unused) slots
  in the main buffer: it covers the whole local space so that every run indexes it by its
  local offset.

They add up, with the state's share of ``padding``, to the bytes of the state's buffers
exactly, on the device, or under the ``host_`` names with offload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..layout import Layout
from ..placement import BufferSpec
from ..rules import ADAMW, UpdateRule
from ..shard_state import part_kind
from ..stored import STORED_PARTS
from .base import reserved_bytes

if TYPE_CHECKING:
    from ..shard_state import ShardState
    from ..stage3.runtime import Stage3Runtime


def state_kinds(rule: UpdateRule | None = None) -> tuple[str, ...]:
    """The optimizer state's memory_stats() keys (device side; ``host_`` + each on the host):
    the master, then every part of the rule's buffers (AdamW: its two moments, then their
    ``_absmax`` and ``_side`` parts)."""
    names = (rule or ADAMW).state_names
    return ("master", *(part_kind(n, p) for p in (*STORED_PARTS, "side") for n in names))


STATE_KINDS = state_kinds()
"""AdamW's state kinds."""

Buffers = dict[str, tuple[int, int, bool]]
"""The state's buffers: kind -> (elements, bytes per element, one slot per local element);
every kind of the rule, (0, 0, ...) when absent."""


def _esize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _per_element(kind: str, rule: UpdateRule) -> bool:
    return kind == "master" or kind in rule.state_names


def spec_buffers(specs: list[BufferSpec], rule: UpdateRule | None = None) -> Buffers:
    """The state's buffers among ``specs`` (what memory_stats() reports before they exist)."""
    rule = rule or ADAMW
    got = {s.kind: (s.numel, _esize(s.dtype)) for s in specs}
    return {k: (*got.get(k, (0, 0)), _per_element(k, rule)) for k in state_kinds(rule)}


def state_buffers(state: ShardState) -> Buffers:
    """The buffers ``state`` holds, read from the tensors themselves."""
    tensors = {"master": state.master, **state.tensors()}
    out: Buffers = {}
    for kind in state_kinds(state.rule):
        t = tensors.get(kind)
        out[kind] = ((0, 0) if t is None else (t.numel(), t.element_size())) + (
            _per_element(kind, state.rule),)
    return out


def state_bytes(bufs: Buffers, local_real: int) -> tuple[dict[str, int], int]:
    """(bytes by kind, padding bytes) of the state's buffers over a local space holding
    ``local_real`` trained elements; every kind of the state (0 when absent)."""
    out: dict[str, int] = {}
    pad = 0
    for kind, (numel, esz, per_element) in bufs.items():
        if per_element:
            out[kind] = local_real * esz
            pad += (numel - local_real) * esz
        else:  # scales and side buffers: every entry belongs to the kind
            out[kind] = numel * esz
    return out, pad


def _host(kinds: dict[str, int]) -> dict[str, int]:
    return {f"host_{k}": v for k, v in kinds.items()}


def slot_numel(layout: Layout) -> int:
    """Elements of a staging slot at stages 1-2: the largest bucket shard."""
    return max((b.shard_numel for b in layout.buckets), default=1)


def _held(rt: Stage3Runtime) -> int:
    """Elements of parameters in this rank's stage-3 slices (the rest is padding)."""
    return sum(sp.numel for u in rt.units for sp in u.plan.rank_pieces(rt.comm.rank))


def _local_real(layout: Layout) -> int:
    return sum(pc.numel for pc in layout.pieces if pc.param >= 0)


def flat_memory(layout: Layout, dtype: torch.dtype, specs: list[BufferSpec], state: Buffers, *,
                buckets: int, overflow: int, scratch: int, in_use: int,
                capacity: int) -> dict[str, int]:
    """Bytes a stage-0/1/2 rank holds for model states, by kind; padding (bucket and shard
    rounding, the state's unused slots) on its own. ``state``: the state's buffers."""
    esz = _esize(dtype)
    psi = sum(layout.plans[g].total_numel for g in range(len(layout.plans)))
    local_real = _local_real(layout)
    kinds, pad = state_bytes(state, local_real)
    out = {"params": psi * esz, "grads": 0, **kinds, "buckets": buckets,
           "padding": pad + (layout.flat_numel - psi) * esz}
    for s in specs:
        if s.kind != "grads":
            continue
        gsz = _esize(s.dtype)  # the parameters' dtype, or the reduce dtype
        if s.numel == layout.flat_numel:  # a full flat gradient (stages 0-1)
            out["grads"] += psi * gsz
            out["padding"] += (layout.flat_numel - psi) * gsz
        else:  # the gradient shard (stage 2; stage 1 with a reduce dtype)
            out["grads"] += local_real * gsz
            out["padding"] += (layout.local_numel - local_real) * gsz
    # Receive buffers of gloo's point-to-point reduce-scatter (stage 1 in place; stage 2
    # with more than 2 ranks): the most held at once. 0 on NCCL.
    out["comm_scratch"] = scratch
    out["arena_in_use"] = in_use
    out["arena_capacity"] = capacity
    out["total"] = in_use + overflow + scratch
    out["device_total"] = out["total"]
    out["host_total"] = 0  # nothing offloaded
    return out


def offload_flat_memory(layout: Layout, dtype: torch.dtype, specs: list[BufferSpec],
                        state: Buffers, *, buckets: int, overflow: int, scratch: int,
                        in_use: int, capacity: int, host_in_use: int,
                        host_capacity: int) -> dict[str, int]:
    """Stages 1-2 with offload, by kind and by side. Device: the flat parameters (2Ψ), stage
    1's full-size gradient (2Ψ), stage 2's bucket pool. Host (``state``: the host state's
    buffers): master and moments (KΨ/N), the gradient shard (2Ψ/N for 16-bit) and two
    staging slots."""
    esz = _esize(dtype)
    psi = sum(p.total_numel for p in layout.plans)
    local_real = _local_real(layout)
    full_grad = any(s.kind == "grads" for s in specs)
    slot = slot_numel(layout)
    pad_local = layout.local_numel - local_real
    out = {"params": psi * esz, "grads": psi * esz if full_grad else 0,
           **dict.fromkeys(state, 0), "buckets": buckets,
           "padding": (layout.flat_numel - psi) * esz * (2 if full_grad else 1),
           "comm_scratch": scratch, "arena_in_use": in_use, "arena_capacity": capacity,
           "total": in_use + overflow + scratch}
    out.update(host_memory(state, local_real, pad_local, esz, 2 * slot * esz, host_in_use,
                           host_capacity))
    out["device_total"] = out["total"]
    return out


def host_memory(state: Buffers, local_real: int, pad_local: int, esz: int, staging: int,
                in_use: int, capacity: int, params: int = 0) -> dict[str, int]:
    """The host side of memory_stats() with offload: the state's kinds (``state``: its
    buffers), the gradient shard of ``local_real`` elements and ``pad_local`` padding ones
    (``esz`` bytes each), ``params``: stage 3's offloaded parameter shard, in bytes."""
    kinds, pad = state_bytes(state, local_real)
    return {**_host(kinds), "host_grads": esz * local_real,
            "host_params": params, "host_staging": staging,
            "host_padding": pad + pad_local * esz,
            "host_arena_in_use": in_use, "host_arena_capacity": capacity, "host_total": in_use}


def planned_flat_memory(layout: Layout, dtype: torch.dtype, specs: list[BufferSpec],
                        host_specs: list[BufferSpec] | None = None,
                        rule: UpdateRule | None = None) -> dict[str, int]:
    """memory_stats() of stages 0-2 before the first step: nothing is allocated yet; the
    blocks the engine will take (``host_specs``: its host arena, with offload), the bucket
    pool included."""
    nbytes = reserved_bytes(specs)
    pool = sum(s.numel * _esize(s.dtype) for s in specs if s.kind == "buckets")
    if host_specs is None:
        return flat_memory(layout, dtype, specs, spec_buffers(specs, rule), buckets=pool,
                           overflow=0, scratch=0, in_use=nbytes, capacity=nbytes)
    host = reserved_bytes(host_specs)
    return offload_flat_memory(layout, dtype, specs, spec_buffers(host_specs, rule),
                               buckets=pool,
                               overflow=0, scratch=0, in_use=nbytes, capacity=nbytes,
                               host_in_use=host, host_capacity=host)


def _gather_stats(rt: Stage3Runtime) -> dict[str, int]:
    g = rt.memory_stats()
    return {f"gather_{k}" if not k.startswith("gather") else k: v
            for k, v in g.items() if not k.startswith("local")}


def scratch_peak(comm: Any) -> int:
    """The collectives' scratch, the most held at once (gloo's point-to-point receive
    buffers, the quantized collectives' payloads): the group's, plus the replicate group's on
    a 2-D mesh (the quantized hops 2-3) and the node group's with hpZ."""
    return sum(int(c.scratch_peak) for c in (comm, getattr(comm, "replicate", None),
                                             getattr(comm, "secondary", None))
               if c is not None)


def with_residuals(out: dict[str, int], part: Any) -> dict[str, int]:
    """``out`` with ``ef_residual``: the error-feedback residuals of the gradient-reduce part
    ``part`` (comm/quantized_parts.py; allocated at each slice's first send, 0 before the
    first step), counted in the device total. Without ``error_feedback`` there is no key, so
    the keys are the same before the first step (no engine yet) and after it."""
    if not getattr(part, "feedback", False):
        return out
    r = int(getattr(part, "residual_bytes", 0))
    out["ef_residual"] = r
    out["total"] += r
    out["device_total"] = out["total"]
    return out


def _secondary_bytes(rt: Stage3Runtime) -> int:
    """hpZ's in-node copy of the parameters (zero/stage3/secondary.py), 0 without it."""
    sec = rt.ctx.secondary
    return 0 if sec is None else sec.nbytes


def stage3_memory(layout: Layout, rt: Stage3Runtime, dtype: torch.dtype, state: Buffers, *,
                  arena_in_use: int) -> dict[str, int]:
    """Stage 3 with its state on the device: this rank's parameter and gradient slices
    (frozen parameters' included), the state of the trained ones (``state``: its buffers),
    the gather arena."""
    L, esz = layout, _esize(dtype)
    gsz = rt.local_grads.element_size()  # the reduce dtype's (the parameters' by default)
    kinds, pad = state_bytes(state, _local_real(L))
    held = _held(rt)  # this rank's slice, frozen parameters and other optimizers' too
    out = {"params": held * esz, "grads": held * gsz, **kinds, "buckets": 0,
           "padding": pad + (rt.local_numel - held) * (esz + gsz)}
    out.update(_gather_stats(rt))
    sec = _secondary_bytes(rt)
    out["hpz_secondary"] = sec
    # The collectives' transient buffers, the most held at once (as gather_peak: not held
    # between steps, so not in the total).
    out["comm_scratch"] = scratch_peak(rt.comm)
    out["total"] = rt.local_numel * (esz + gsz) + arena_in_use + sec
    out["device_total"] = out["total"]
    out["host_total"] = 0  # nothing offloaded
    return out


def stage3_offload_memory(layout: Layout, rt: Stage3Runtime, dtype: torch.dtype,
                          state: Buffers, *, arena_in_use: int, slot: int, host_in_use: int,
                          host_capacity: int) -> dict[str, int]:
    """Stage 3 with ZeRO-Offload: on the device only the gathered units and (without
    offload_params) this rank's parameter slice; on the host the state (``state``: its
    buffers), the gradient slice (the runtime's host arena) and, with offload_params, the
    parameter slice."""
    L, esz = layout, _esize(dtype)
    kinds, pad = state_bytes(state, _local_real(L))
    held = _held(rt)
    on_host = rt.offload_params
    dev_params = 0 if on_host else rt.local_numel * esz
    out = {"params": 0 if on_host else held * esz, "grads": 0,
           **dict.fromkeys(state, 0), "buckets": 0,
           "padding": 0 if on_host else (rt.local_numel - held) * esz}
    out.update(_gather_stats(rt))
    sec = _secondary_bytes(rt)
    out["hpz_secondary"] = sec
    out["total"] = dev_params + arena_in_use + sec
    out["device_total"] = out["total"]
    rt_host = int(rt.grad_arena.stats()["in_use"])
    rt_cap = int(rt.grad_arena.stats()["capacity"])
    if on_host:
        rt_host += int(rt.param_arena.stats()["in_use"])
        rt_cap += int(rt.param_arena.stats()["capacity"])
    out.update({
        **_host(kinds), "host_grads": held * esz,
        "host_params": held * esz if on_host else 0,
        "host_staging": 2 * slot * esz,
        "host_padding": pad + (rt.local_numel - held) * esz * (2 if on_host else 1),
        "host_arena_in_use": host_in_use + rt_host,
        "host_arena_capacity": host_capacity + rt_cap,
        "host_total": host_in_use + rt_host,
    })
    return out
