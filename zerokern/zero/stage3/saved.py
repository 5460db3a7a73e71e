"""Stage 3 and autograd's saved tensors (step 2 of unit.py's story).

Autograd keeps views of the gathered parameters for the backward (e.g. ``weight.t()`` of a
linear layer). A released buffer is reused by the next unit, so such a view would read
someone else's weights. While the model's forward runs, tensors saved for backward that live
in the gather arena are packed as (unit, offset, shape, stride) and unpacked against wherever
that unit is gathered when backward needs them (gathering it first if it is released).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .runtime import Stage3Runtime


class SavedTensorHooks:
    """The root forward's saved-tensor hooks (they turn views of gathered parameters into
    references that the backward re-gathers), entered at most once and always left: by the
    root's forward hook, or by its always-called hook when the forward raised."""

    def __init__(self, rt: Stage3Runtime) -> None:
        self.rt = rt
        self._ctx: Any = None
        # A model of several dtypes has one runtime per dtype: the first's hooks pack the
        # views of every runtime's units (only the innermost saved-tensor hooks see a tensor),
        # the others' never install theirs (``passive``).
        self.rts: list[Stage3Runtime] = [rt]
        self.passive = False

    @property
    def active(self) -> bool:
        """Whether the hooks are installed (the root's forward runs)."""
        return self._ctx is not None

    def enter(self) -> None:
        """Install the hooks (no-op when they already are)."""
        if self._ctx is None and not self.passive:
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self._ctx.__enter__()

    def exit(self) -> None:
        """Remove the hooks (no-op when they are not installed)."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def pack(self, t: torch.Tensor) -> Any:
        """``t`` itself, or a reference when it lives in a gathered unit's arena block."""
        for i, rt in enumerate(self.rts):
            if t.device != rt.device or t.dtype != rt.dtype:
                continue
            base = rt.gather_arena.buffer
            if t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
                continue
            # Block offsets count from the arena's base, which may start inside its storage.
            byte = t.storage_offset() * t.element_size() - base.storage_offset()
            for u in rt.units:
                if (u.block is not None
                        and u.block.offset <= byte < u.block.offset + u.block.nbytes):
                    return (_GatheredRef, u.index, byte - u.block.offset, tuple(t.shape),
                            tuple(t.stride()), i)
        return t

    def unpack(self, packed: Any) -> torch.Tensor:
        """The saved tensor, re-pointed into the unit's current buffer for a reference."""
        if not (isinstance(packed, tuple) and packed and packed[0] is _GatheredRef):
            return packed
        _, idx, rel, shape, stride, which = packed
        rt = self.rts[which]
        u = rt.units[idx]
        if not u.gathered:
            rt.pre_backward(u, None)
        assert u.buf is not None
        esz = u.buf.element_size()
        if u.block is not None:
            base = rt.gather_arena.buffer
            start = (base.storage_offset() + u.block.offset + rel) // esz
            return base.view(rt.dtype).as_strided(shape, stride, start)
        return u.buf.as_strided(shape, stride, u.buf.storage_offset() + rel // esz)


class _GatheredRef:
    """Marker for a saved tensor packed as a reference into a gathered unit."""
