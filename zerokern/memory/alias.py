"""A view of a flat buffer that owns a storage object of its own.

Parameters bound to a flat buffer (stages 0-2) are views of it, and ``torch.save`` writes a
view's whole storage: a saved ``model.state_dict()`` or parameter would carry the entire
arena (parameters, gradients, optimizer state) instead of its own bytes. ``own_storage(view)``
returns a tensor over the same memory whose storage covers exactly the view's bytes, so what
users save of the model holds each tensor's own bytes, as a plain model's would, and loads
with a plain ``torch.load`` anywhere.

The new storage is made through DLPack: the capsule holds a reference to ``view`` (and so to
the buffer under it) until the last tensor on the new storage is gone, so a saved or detached
parameter can never point at freed memory, whatever outlives the optimizer. Writes through
either tensor are writes to the same bytes; only the storage objects (and version counters)
differ.
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view``'s elements in a tensor of the same shape, dtype and device whose storage is
    exactly ``view.numel() * view.element_size()`` bytes at ``view.data_ptr()`` (``view``
    must be contiguous). The buffer under ``view`` stays alive as long as the result does."""
    if not view.is_contiguous():
        raise ValueError("own_storage: view must be contiguous")
    if view.numel() == 0:
        return torch.empty(view.shape, dtype=view.dtype, device=view.device)
    out = from_dlpack(to_dlpack(view.detach()))
    if out.data_ptr() != view.data_ptr() or out.dtype != view.dtype:  # never expected
        raise RuntimeError("own_storage: DLPack did not alias the view")
    return out
