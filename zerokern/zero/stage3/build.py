"""How a sharded model is laid out: its units' flat spaces (plan.py), where each unit's slice
starts in this rank's ``local_params`` / ``local_grads``, the gather arena they need, and the
initial slices, taken from rank 0. The runtime (runtime.py) builds its units from here once
and then only moves them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..plan import UnitPlan, plan_units
from ..state_format import QUANT_ALIGN, quant_align
from .context import UnitContext, gather_arena_bytes
from .unit import Unit


def split_by_dtype(units: list[tuple[str, torch.nn.Module, list[torch.nn.Parameter]]]
                   ) -> list[list[tuple[str, torch.nn.Module, list[torch.nn.Parameter]]]]:
    """The units of each dtype, in the order the dtypes first appear: a unit holding several
    becomes one unit per dtype (named ``name[dtype]``), each kept by that dtype's runtime
    with one flat buffer of its own; every dtype keeps a root (the last entry). One dtype:
    ``[units]`` unchanged."""
    dtypes: list[torch.dtype] = []
    for _, _, ps in units:
        for p in ps:
            if p.dtype not in dtypes:
                dtypes.append(p.dtype)
    if len(dtypes) <= 1:
        return [units]
    out = []
    for dt in dtypes:
        tag = str(dt).removeprefix("torch.")
        mine = []
        for i, (name, mod, ps) in enumerate(units):
            sub = [p for p in ps if p.dtype == dt]
            split = len({p.dtype for p in ps}) > 1
            if sub or i == len(units) - 1:  # the root stays, even empty
                mine.append((f"{name}[{tag}]" if split else name, mod, sub))
        out.append(mine)
    return out


class ModelLayout:
    """The units' plans and slice offsets for ``world_size`` ranks, ``units`` as shard_model
    found them ((name, module, parameters), the root's among them)."""

    def __init__(self, root: torch.nn.Module,
                 units: list[tuple[str, torch.nn.Module, list[torch.nn.Parameter]]],
                 world_size: int, prefetch: int) -> None:
        self.specs, self.prefetch = units, prefetch
        # Parameters large enough for 8-bit moments start on a 256-element block, and slices
        # end on one, whatever optimizer comes next: ZeroAdamW(moments="int8") then finds its
        # quantization blocks whole on one rank (zero/state_format.py). Smaller ones pack.
        numels = [[p.numel() for p in ps] for _, _, ps in units]
        self.plans: list[UnitPlan] = plan_units(
            # units' slices end on QUANT_ALIGN: see [Note: blocks never straddle shards]
            numels, world_size, QUANT_ALIGN, [[quant_align(n) for n in ns] for ns in numels])
        self.starts = [0]
        for plan in self.plans:
            self.starts.append(self.starts[-1] + plan.shard_numel)
        self.local_numel = self.starts[-1]
        self.is_root = [mod is root for _, mod, _ in units]

    def units(self, ctx: UnitContext) -> list[Unit]:
        """The units over ``ctx``, SHARDED, in the order shard_model found them."""
        return [Unit(i, name, mod, ps, [p.shape for p in ps], plan, start, ctx, is_root=r)
                for i, ((name, mod, ps), plan, start, r) in enumerate(
                    zip(self.specs, self.plans, self.starts, self.is_root))]

    def gather_bytes(self, dtype: torch.dtype, grad_dtype: torch.dtype) -> int:
        """The gather arena's capacity for parameters of ``dtype`` and gradients reduced in
        ``grad_dtype``: the root's and the other units' padded numels (gather_arena_bytes)."""
        roots = [pl.padded_numel for pl, r in zip(self.plans, self.is_root) if r]
        others = [pl.padded_numel for pl, r in zip(self.plans, self.is_root) if not r]
        return gather_arena_bytes(roots, others, self.prefetch,
                                  torch.empty(0, dtype=dtype).element_size(),
                                  torch.empty(0, dtype=grad_dtype).element_size())


def shard_initial(units: list[Unit], ctx: UnitContext) -> None:
    """Copy (rank 0's) full parameters into this rank's slices and release them: each unit's
    values from the shard group's rank 0, then, on a 2-D mesh, every replica's slices from the
    first replica's (global rank 0's), through the gather part. The setup's traffic is not a
    step's: the counts start from zero after it."""
    with torch.no_grad():
        for u in units:
            full = torch.zeros(u.plan.padded_numel, dtype=ctx.dtype, device=ctx.device)
            for p, off, n in zip(u.params, u.plan.param_offsets, u.plan.numels):
                full.narrow(0, off, n).copy_(p.detach().reshape(-1))
            ctx.param_comm.take_initial(full, f"initial parameters of unit {u.name}")
            u.take_shard(full)
        ctx.param_comm.take_initial_slices(ctx.local_params, "initial parameter slices")
    ctx.comm.reset_stats()


def local_pieces(units: list[Any], rank: int, local_params: torch.Tensor
                 ) -> list[tuple[torch.nn.Parameter, int, int, torch.Tensor]]:
    """This rank's pieces of every parameter of ``units``, frozen ones included: (parameter,
    first element, numel, writable view of the stored slice in ``local_params``)."""
    out = []
    for u in units:
        for sp in u.plan.rank_pieces(rank):
            out.append((u.params[sp.param_index], sp.param_offset, sp.numel,
                        local_params.narrow(0, u.shard_start + sp.local_offset, sp.numel)))
    return out
