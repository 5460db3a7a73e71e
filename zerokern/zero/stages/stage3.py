"""Stage 3, P_os+g+p: parameters partitioned as well ((2 + 2 + K) Psi / N).

The parameter side (gathering units just in time, reduce-scattering each unit's gradients as
its backward finishes) is the runtime of ``shard_model`` (zero/stage3_runtime.py); it owns this
rank's parameter and gradient slices. The optimizer side here holds the fp32 master (16-bit
params) and the moments of those slices and updates them; the new 16-bit slice is all the
next forward gathers, so nothing is gathered after the step.
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm import Comm
from ..layout import Layout
from ..stage3_runtime import Stage3Runtime
from .base import BufferSpec, Engine, Run


class Stage3(Engine):
    stage = 3

    def __init__(self, layout: Layout, params: list[torch.nn.Parameter], comm: Comm, *,
                 dtype: torch.dtype, device: torch.device, overlap: bool,
                 backend: str | None, runtime: Stage3Runtime) -> None:
        super().__init__(layout, params, comm, dtype=dtype, device=device, overlap=overlap,
                         backend=backend)
        self.rt = runtime
        with torch.no_grad():
            self.alloc_state()
            self.init_master()

    @classmethod
    def buffer_specs(cls, layout: Layout, dtype: torch.dtype) -> list[BufferSpec]:
        return cls.state_specs(layout, dtype)

    # -- gradients: reduced by the runtime during backward ---------------------------------------
    def on_grad(self, index: int) -> None:
        raise AssertionError("stage 3 gradients arrive through the shard_model runtime")

    def finish_grads(self) -> list[bool]:
        self.rt.prepare_step()
        return [self.rt.got_grad.get(id(p), False) for p in self.params]

    def grad_slices(self, start: int, numel: int) -> list[torch.Tensor]:
        return [self.rt.local_grads.narrow(0, start, numel)]

    def end_step(self) -> None:
        self.rt.new_step()

    def zero_grad(self, set_to_none: bool) -> None:
        for p in self.params:
            p.grad = None
        self.rt.new_step()

    def set_sync(self, value: bool) -> None:
        self.rt.sync = value

    # -- update: this rank's slices ------------------------------------------------------------
    def update(self, runs: list[Run], groups: list[dict[str, Any]], grad_scale: float,
               active: list[bool]) -> None:
        self.update_in_place(runs, groups, grad_scale, self.rt.local_grads, self.rt.local_params)

    # -- sharded state ----------------------------------------------------------------------
    def values(self, start: int, numel: int) -> torch.Tensor:
        src = self.master if self.master is not None else self.rt.local_params
        return src.narrow(0, start, numel)

    def init_master(self) -> None:
        if self.master is not None:
            self.master.copy_(self.rt.local_params)

    def sync_params(self, gather: bool) -> None:
        for u in self.rt.units:  # a unit gathered now would keep its old values
            self.rt.release(u)
        if self.master is None:
            return
        for pc in self.layout.pieces:
            own = self.rt.local_params.narrow(0, pc.local_start, pc.numel)
            master = self.master.narrow(0, pc.local_start, pc.numel)
            if pc.param >= 0:
                own.copy_(master)
            else:  # a frozen parameter's unused master slot mirrors it, as init_master left it
                master.copy_(own)

    # -- accounting -------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        L, rt = self.layout, self.rt
        esz = torch.empty(0, dtype=self.dtype).element_size()
        local_real = sum(pc.numel for pc in L.pieces if pc.param >= 0)
        nstate = 3 if self.master is not None else 2
        held = sum(pc.numel for pc in L.pieces)  # this rank's slice, frozen params too
        out = {"params": held * esz, "grads": held * esz,
               "master": local_real * 4 if self.master is not None else 0,
               "exp_avg": local_real * 4, "exp_avg_sq": local_real * 4, "buckets": 0,
               "padding": (L.local_numel - local_real) * 4 * nstate
               + 2 * (rt.local_numel - held) * esz}
        g = rt.memory_stats()
        out.update({f"gather_{k}" if not k.startswith("gather") else k: v
                    for k, v in g.items() if not k.startswith("local")})
        out["total"] = 2 * rt.local_numel * esz + int(self.arena.stats()["in_use"])
        out["device_total"] = out["total"]
        out["host_total"] = 0  # nothing offloaded
        return out
