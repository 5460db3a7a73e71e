"""Parameters whose ``.data`` was replaced after ZeroAdamW (or shard_model) bound them.

Stages 0-2 make every parameter a view of one flat buffer at the first step; stage 3 keeps a
released parameter as a zero-stride placeholder and its values in this rank's slices. Code
written for torch replaces a parameter's tensor in two ways:

- ``p.data = t`` of the same shape, dtype and device (weight surgery, re-initialisation):
  torch's AdamW trains ``t`` from then on. ZeroAdamW would keep updating the old storage
  and ``p`` would stay frozen for ever; instead ``t``'s values are adopted: they go into the
  flat buffer (stage 3: this rank's slices), the fp32 master of that parameter takes them,
  and ``p`` is bound again.
- ``model.to(dtype)`` / ``.half()`` / ``.bfloat16()`` / ``model.to(device)`` after the
  buffers exist (or ``p.data = t`` of another dtype, device or shape): the buffers cannot
  follow (DDP's buckets cannot either). Refused with an error that says so, at the first
  gradient hook or step (stage 3: the next gather), before anything is updated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..memory.alias import own_storage

if TYPE_CHECKING:  # type names only: stage3/adopt.py imports this file (no cycle)
    from .layout import Layout
    from .param_table import ParamTable
    from .stages import Engine


def changed_error(who: str, what: str, now: torch.Tensor, dtype: torch.dtype,
                  device: torch.device, shape: torch.Size, when: str) -> RuntimeError:
    if tuple(now.shape) != tuple(shape):
        return RuntimeError(
            f"{who}: {what} now has shape {tuple(now.shape)} but had {tuple(shape)} at "
            f"{when} (`p.data = t` with another shape). Its optimizer state has the old shape "
            f"(torch's AdamW cannot continue either): build the model's final shapes first, "
            f"or a new optimizer after the change")
    return RuntimeError(
        f"{who}: {what} is now {now.dtype} on {now.device} but zerokern holds it as {dtype} "
        f"on {device} since {when} (model.to(...), .half(), .bfloat16(), .cuda() or "
        f"`p.data = t` afterwards). Its flat buffers keep their dtype and device: cast or move "
        f"the model before building ZeroAdamW (and before shard_model at stage 3). For 16-bit "
        f"training build ZeroAdamW on the 16-bit model: it keeps the fp32 master itself")


def check_grad_param(table: ParamTable, index: int, dtype: torch.dtype,
                     device: torch.device) -> None:
    """Stages 0-2, in the gradient hook: the gradient of a cast or moved parameter cannot go
    into the flat buckets (torch raised a TypeError deep in the bucket copy)."""
    p, shape = table.params[index], table.shapes[index]
    if p.dtype != dtype or p.device != device or p.shape != shape:
        raise changed_error("ZeroAdamW", f"parameter {index}", p, dtype, device, shape,
                            "ZeroAdamW's first step()")


def adopt_flat(table: ParamTable, eng: Engine, layout: Layout, dtype: torch.dtype,
               device: torch.device) -> None:
    """Stages 0-2: every parameter still a view of the flat buffer, or adopted into it."""
    flat = eng.flat_param
    base, esz = flat.data_ptr(), flat.element_size()
    adopted: set[int] = set()
    for i, p in enumerate(table.params):
        off = layout.param_flat_offset[i]
        if p.data_ptr() == base + off * esz or table.shapes[i].numel() == 0:
            continue
        if p.dtype != dtype or p.device != device or p.shape != table.shapes[i]:
            raise changed_error("ZeroAdamW", f"parameter {i}", p, dtype, device,
                                table.shapes[i], "ZeroAdamW's first step()")
        view = flat.narrow(0, off, p.numel())
        view.copy_(p.detach().reshape(-1))
        p.data = own_storage(view).view_as(p)  # bound as the stage binds it (stages/flat.py)
        adopted.add(i)
    if adopted and eng.master is not None:
        for pc in layout.pieces:
            if pc.param in adopted:
                src = flat.narrow(0, layout.param_flat_offset[pc.param] + pc.param_offset,
                                  pc.numel)
                eng.values(pc.local_start, pc.numel).copy_(src)


def adopt_stage3(rt: Any, table: ParamTable, eng: Engine, layout: Layout) -> None:
    """Stage 3: released parameters given new values are adopted by the runtime (at the next
    gather, or here); the fp32 master of those parameters takes them."""
    rt.adopt_assigned()
    adopted = {table.index.get(id(p)) for p in rt.take_adopted()}
    adopted.discard(None)
    if not adopted or eng.master is None:
        return
    for pc in layout.pieces:
        if pc.param in adopted:
            eng.values(pc.local_start, pc.numel).copy_(rt.local_params.narrow(
                0, layout.to_slice(pc.local_start, pc.numel), pc.numel))
