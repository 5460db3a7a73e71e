"""hpZ (ZeRO++'s hierarchical partitioning): a secondary, in-node copy of the parameters, so
that the backward's gathers stay inside the node.

``shard_model(model, mesh=(R, S) mesh, hpz=True)``: the primary partition is over all R * S
ranks (the parameter slices, the gradients and the optimizer state are 1/(R S) per rank, as
on a flat group of R S ranks: ZeRO-3 across the nodes, not hybrid sharding). A unit's first
gather after a forward begins crosses the nodes (an all-gather over every rank); once it is
done each rank keeps its node's share of the result in a persistent buffer: the shard
group's (mesh dim 1, the node) rank ``s`` keeps elements ``[s P/S, (s+1) P/S)`` of the unit's
padded flat space of P elements. The unit's later gathers until the next forward (its
backward, activation checkpointing's recompute) are all-gathers of those shares within the
node, in the parameters' dtype: the same bits the forward used, whatever ``gather_dtype``.

Validity. A share is what the primary slices held at the unit's last crossing gather. It is
dropped (every unit's) when a forward of the root begins, at the step boundary (``new_step``)
and when the slices are written (a state or checkpoint load, ``model.load_state_dict``), and a
unit's own when values assigned to its placeholders are adopted into its slice: a gather
never reads a share older than the slices. Exact gathers (``full_state_dict``) neither read
nor fill it.

Memory: sum over units of P/S elements of the parameters' dtype, held for the model's
lifetime (``memory_stats()["hpz_secondary"]``, ``zerokern.formulas.hpz_secondary_bytes``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...comm import Comm
from ...comm.parts import gather_part

if TYPE_CHECKING:
    from .unit import Unit


class Secondary:
    """The in-node shares of every unit (module docstring), over the node group ``node``."""

    def __init__(self, node: Comm, padded_numels: list[int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.node = node
        self.part = gather_part(node)  # the node group's plain (16-bit) gather
        s = node.world_size
        self.spans: list[tuple[int, int]] = []
        off = 0
        for p in padded_numels:
            assert p % s == 0, "a unit's padded space is a multiple of the world size"
            self.spans.append((off, p // s))
            off += p // s
        self.flat = torch.empty(off, dtype=dtype, device=device)
        self.valid: set[int] = set()  # units whose share the slices still match
        self.filling: set[int] = set()  # units whose crossing gather will fill their share

    def share(self, index: int) -> torch.Tensor:
        """Unit ``index``'s share of this rank (P/S elements)."""
        off, n = self.spans[index]
        return self.flat.narrow(0, off, n)

    def holds(self, u: Unit) -> bool:
        """Whether ``u``'s next gather can stay in the node."""
        return u.index in self.valid

    def gather(self, u: Unit, buf: torch.Tensor, label: str, *, async_op: bool) -> Any:
        """``buf`` = the node's shares of ``u``, in node-rank order: the unit's full padded
        space (a Handle, or None when done at once)."""
        return self.part.gather(buf, self.share(u.index), f"{label} (hpZ, in node)",
                                async_op=async_op)

    def will_fill(self, u: Unit) -> None:
        """``u``'s crossing gather was started: its result fills the share (``gathered``)."""
        self.valid.discard(u.index)
        self.filling.add(u.index)

    def gathered(self, u: Unit) -> None:
        """``u`` is GATHERED: after a crossing gather, keep this rank's share of it."""
        if u.index not in self.filling or u.buf is None:
            return
        off, n = self.spans[u.index]
        self.flat.narrow(0, off, n).copy_(u.buf.narrow(0, self.node.rank * n, n))
        self.filling.discard(u.index)
        self.valid.add(u.index)

    def drop(self, index: int | None = None) -> None:
        """Unit ``index``'s share (None: every unit's) no longer matches the slices."""
        if index is None:
            self.valid.clear()
            self.filling.clear()
        else:
            self.valid.discard(index)
            self.filling.discard(index)

    @property
    def nbytes(self) -> int:
        """Bytes of the shares (held for the model's lifetime)."""
        return self.flat.numel() * self.flat.element_size()
