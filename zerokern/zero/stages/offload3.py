"""Stage 3 with ZeRO-Offload (``ZeroAdamW(..., stage=3, offload="cpu")``), and with the
parameter slices in host memory too when the model was sharded with
``shard_model(..., offload_params=True)`` (ZeRO-Infinity's ``offload_param``).

The device keeps only the gathered units and, without ``offload_params``, this rank's
16-bit parameter slice (2Ψ/N). The host arena holds the fp32 master, both moments and the
staging slots; the runtime's host arenas hold the gradient slice (and the parameter slice).

Backward: each unit's gradients are reduce-scattered in place into its gather buffer and
landed on the host through the staging slots (stage3_runtime.py). Step: unit by unit, the
CPU kernel updates the host master and writes the new 16-bit slice into a staging slot in
the same pass, copied back into the device slice (with ``offload_params`` it writes the host
slice directly). Bitwise equal to stage 3 without offload for the reasons given in
offload_flat.py: the same reduced values, the same norm, the same elementwise kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm import Comm
from ..layout import Layout
from ..offload import HostArena, OffloadPipeline
from ..stage3_runtime import Stage3Runtime
from .base import BufferSpec, Run
from .stage3 import Stage3


class Stage3Offload(Stage3):
    offload = True

    def __init__(self, layout: Layout, params: list[torch.nn.Parameter], comm: Comm, *,
                 dtype: torch.dtype, device: torch.device, overlap: bool,
                 backend: str | None, runtime: Stage3Runtime) -> None:
        super().__init__(layout, params, comm, dtype=dtype, device=device, overlap=overlap,
                         backend=backend, runtime=runtime)

    @classmethod
    def buffer_specs(cls, layout: Layout, dtype: torch.dtype) -> list[BufferSpec]:
        return []  # nothing of the optimizer on the device

    @staticmethod
    def _slot_numel(rt: Stage3Runtime) -> int:
        return max(u.plan.shard_numel for u in rt.units)

    def alloc_state(self) -> None:
        rt = self.rt
        n = self.layout.local_numel
        # fp32 parameters kept in host memory are their own master; every other case updates
        # a host fp32 copy and sends the result to the device slice.
        self.has_master = self.dtype != torch.float32 or not rt.offload_params
        slot = self._slot_numel(rt)
        specs = ([("master", n, torch.float32)] if self.has_master else []) + [
            ("exp_avg", n, torch.float32), ("exp_avg_sq", n, torch.float32),
            ("staging", slot, self.dtype), ("staging", slot, self.dtype)]
        self.host = HostArena(specs, self.device)
        self.pipe = OffloadPipeline(self.host, self.device, len(rt.units), slot, self.dtype,
                                    self.backend)
        self.master = self.host.alloc("master", n, torch.float32) if self.has_master else None
        self.exp_avg = self.host.alloc("exp_avg", n, torch.float32)
        self.exp_avg_sq = self.host.alloc("exp_avg_sq", n, torch.float32)
        rt.offload_grads(self.pipe)

    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        rt = self.rt
        on_host = rt.offload_params
        for u in rt.units:  # unit by unit: a unit's range fits a staging slot
            lo, hi = u.shard_start, u.shard_start + u.plan.shard_numel
            for r in runs:
                a, b = max(r.start, lo), min(r.stop, hi)
                if a >= b:
                    continue
                n = b - a
                own = rt.local_params.narrow(0, a, n)
                grad = rt.local_grads.narrow(0, a, n)
                m, v = self.exp_avg.narrow(0, a, n), self.exp_avg_sq.narrow(0, a, n)
                grp = groups[r.group]
                if self.master is None:  # fp32 slice in host memory: updated in place
                    self.pipe.update(u.index, grp, own, grad, m, v, r.step, grad_scale, None)
                elif on_host:
                    self.pipe.update(u.index, grp, self.master.narrow(0, a, n), grad, m, v,
                                     r.step, grad_scale, None, lp_host=own)
                else:
                    self.pipe.update(u.index, grp, self.master.narrow(0, a, n), grad, m, v,
                                     r.step, grad_scale, own)
        # The next forward's gathers read the device slices after these copies.
        self.pipe.fence_returns()
        for u in rt.units:
            self.pipe.returned(u.index)

    def end_step(self) -> None:
        super().end_step()
        self.pipe.end_step()

    def memory_stats(self) -> dict[str, int]:
        L, rt = self.layout, self.rt
        esz = torch.empty(0, dtype=self.dtype).element_size()
        local_real = sum(pc.numel for pc in L.pieces if pc.param >= 0)
        held = sum(pc.numel for pc in L.pieces)
        dev_params = 0 if rt.offload_params else rt.local_numel * esz
        out = {"params": 0 if rt.offload_params else held * esz, "grads": 0, "master": 0,
               "exp_avg": 0, "exp_avg_sq": 0, "buckets": 0,
               "padding": 0 if rt.offload_params else (rt.local_numel - held) * esz}
        g = rt.memory_stats()
        out.update({f"gather_{k}" if not k.startswith("gather") else k: v
                    for k, v in g.items() if not k.startswith("local")})
        out["total"] = dev_params + int(self.arena.stats()["in_use"])
        out["device_total"] = out["total"]
        h = self.host.stats()
        nmaster = local_real * 4 if self.master is not None else 0
        slot = self._slot_numel(rt) * esz
        rt_host = int(rt.grad_arena.stats()["in_use"])
        if rt.offload_params:
            rt_host += int(rt.param_arena.stats()["in_use"])
        out.update({
            "host_master": nmaster, "host_exp_avg": local_real * 4,
            "host_exp_avg_sq": local_real * 4, "host_grads": held * esz,
            "host_params": held * esz if rt.offload_params else 0,
            "host_staging": 2 * slot,
            "host_padding": (L.local_numel - local_real) * (8 + (4 if self.master is not None
                                                                  else 0))
            + (rt.local_numel - held) * esz * (2 if rt.offload_params else 1),
            "host_arena_in_use": h["in_use"] + rt_host,
            "host_arena_capacity": h["capacity"] + int(rt.grad_arena.stats()["capacity"])
            + (int(rt.param_arena.stats()["capacity"]) if rt.offload_params else 0),
            "host_total": h["in_use"] + rt_host,
        })
        return out
