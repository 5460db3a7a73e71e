"""The quantized communication parts (ZeRO++'s qwZ and qgZ as parts of comm/parts.py): the
layouts of ``gather_dtype="int8"`` and ``reduce_dtype="int8"`` / ``"int4"``.

Each is one more subclass of a part, overriding only how it reaches the wire; the stages and
stage 3's units call the same verbs and do not change.

Blocks: 256 elements for int8, 32 for int4 (``zerokern.quant.comm_codec.WIRE_BLOCK``; hop 3,
int8, at 256 also after an int4 reduce).

* :class:`QuantizedFlatGather` / :class:`QuantizedHybridGather`: ``_all_gather`` is
  ``quantized_all_gather`` (int8 codes and one fp32 scale per block of each rank's shard).
  Every rank decodes every shard, its own included, from the gathered bytes, so the gathered
  parameters are the same bits on every rank; the shard it was quantized from (stage 3's
  slice, stages 1-2's fp32 master) is never touched.
* :class:`QuantizedFlatReduce`: ``_reduce_scatter`` is ``quantized_reduce_scatter`` (each
  destination's chunk quantized, an all-to-all, the received chunks decoded and summed in
  fp32 in rank order, rounded once into the gradient dtype).
* :class:`QuantizedHybridReduce` (2-D mesh, qgZ's two hops): within the shard group as the
  flat one (hop 1), then across the replicate group (``_sum_replicas``) a quantized
  reduce-scatter of the chunk's R parts, summed in fp32 (hop 2), and an int8 all-gather of
  those sums (hop 3), so that the replicas decode the same bits. A chunk whose size is not a
  multiple of R is zero-padded to one for hops 2 and 3 (the padding travels and is counted).

Error feedback (``ZeroAdamW(error_feedback=True)``, with ``reduce_dtype="int8"`` / ``"int4"``;
the idea of LoCo, arXiv 2407.04480, without its compression of the residual): each rank keeps,
per slice it sends (a bucket or a unit; on a mesh also the chunk of hop 2 and the sums of hop
3), the fp32 residual of its last send, adds it to the next send of the same slice before
quantizing, and keeps what the codes missed. The sum of what a rank sent over k steps is then
the sum of what it should have sent minus one residual (at most one send's quantization error),
instead of k errors. Residual memory per rank: the sizes of what it sends, 4 bytes an element
(``zerokern.formulas.error_feedback_bytes``; ``memory_stats()["ef_residual"]``).

Accounting (``CommStats``): the bytes moved, scales and padding included, under the kinds
``all_gather_q8`` / ``reduce_scatter_q8`` / ``reduce_scatter_q4`` of each mesh dim; they equal
``zerokern.formulas.quantized_all_gather_bytes`` / ``quantized_2hop_bytes`` per collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..quant.comm_codec import wire_block
from .mesh import MeshInfo
from .parts import FlatGather, FlatReduce, HybridGather, HybridReduce
from .quantized import quantized_all_gather, quantized_reduce_scatter

QUANTIZED_DTYPES = {"int8": 8, "int4": 4}
"""The spellings of ``reduce_dtype`` / ``gather_dtype`` that quantize, and their code widths."""


@dataclass(frozen=True)
class WireFormat:
    """What the parts put on the wire: ``reduce_bits`` (8, 4, or None: the gradient dtype),
    ``gather_bits`` (8, or None: the parameter dtype) and ``feedback`` (error feedback on
    the quantized reduce)."""

    reduce_bits: int | None = None
    gather_bits: int | None = None
    feedback: bool = False

    @classmethod
    def of(cls, reduce_dtype: Any, gather_dtype: Any, feedback: bool = False) -> WireFormat:
        """The wire format of ``ZeroConfig``'s (validated) ``reduce_dtype``,
        ``gather_dtype`` and ``error_feedback``: a torch dtype or None is not quantized."""
        return cls(QUANTIZED_DTYPES.get(reduce_dtype) if isinstance(reduce_dtype, str)
                   else None,
                   QUANTIZED_DTYPES.get(gather_dtype) if isinstance(gather_dtype, str)
                   else None, bool(feedback))

    @property
    def quantized(self) -> bool:
        """Whether anything travels quantized."""
        return self.reduce_bits is not None or self.gather_bits is not None


GATHER_ACROSS_BITS = 8
"""Hop 3's code width: the replicas' reduced sums are all-gathered in int8 (also after an
int4 reduce), as ``quantized_reduce_scatter_2hop``'s default."""


class _QuantizedShardHop:
    """The shard group's reduce-scatter in ``bits`` (8 or 4) on the wire, summed in fp32:
    what both quantized reduce parts put in place of the plain one. ``feedback``: error
    feedback, each send's residual kept (``residuals``) and added to the next send of the
    same slice (module docstring)."""

    comm: Any

    def __init__(self, mesh: MeshInfo, dtype: torch.dtype | None, bits: int,
                 feedback: bool = False) -> None:
        super().__init__(mesh, dtype)  # type: ignore[call-arg]
        self.bits, self.block = bits, wire_block(bits)
        self.feedback = feedback
        # Error feedback's residuals, fp32, one per slice sent (a bucket's or a unit's
        # label, and the hop), allocated at its first send: the slices are the same every
        # step, so the residual of one send goes into the next send of the same slice.
        self.residuals: dict[str, torch.Tensor] = {}
        # Residuals a checkpoint restored (checkpoint/residuals.py), taken by the slice of the
        # same label and size at its first send.
        self.restored: dict[str, torch.Tensor] = {}

    def residual(self, key: str, like: torch.Tensor, group: Any) -> torch.Tensor | None:
        """The residual of slice ``key`` (``like``'s size; restored or zeros at first), or
        None without feedback or with a group of one rank (nothing is quantized)."""
        if not self.feedback or group.world_size == 1:
            return None
        r = self.residuals.get(key)
        if r is None or r.numel() != like.numel():
            old = self.restored.pop(key, None)
            if old is not None and old.numel() == like.numel():
                r = old.to(device=like.device, dtype=torch.float32).contiguous()
            else:
                r = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
            self.residuals[key] = r
        return r

    @property
    def residual_bytes(self) -> int:
        """Bytes of the residuals held now (restored ones not yet taken included)."""
        return sum(r.numel() * r.element_size() for d in (self.residuals, self.restored)
                   for r in d.values())

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, label: str,
                        async_op: bool) -> Any:
        return quantized_reduce_scatter(self.comm, out, inp, bits=self.bits, block=self.block,
                                        label=label, async_op=async_op,
                                        residual=self.residual(label, inp, self.comm))


class QuantizedFlatReduce(_QuantizedShardHop, FlatReduce):
    """The gradient-reduce part of a flat group, quantized to ``bits`` (8 or 4) on the wire."""


class _AcrossHops:
    """Hops 2 and 3 of one slice: ``wait()`` waits for hop 2's reduce-scatter (started
    already), runs hop 3's all-gather and puts the result into the slice."""

    def __init__(self, part: QuantizedHybridReduce, t: torch.Tensor, full: torch.Tensor,
                 mine: torch.Tensor, handle: Any, label: str) -> None:
        self.part, self.t, self.full, self.mine = part, t, full, mine
        self.handle, self.label, self.done = handle, label, False

    def wait(self, timeout: float | None = None) -> bool:
        if not self.done:
            if self.handle is not None:
                self.handle.wait(timeout)
            part = self.part
            quantized_all_gather(part.replicate, self.full, self.mine,
                                 bits=GATHER_ACROSS_BITS, block=wire_block(GATHER_ACROSS_BITS),
                                 label=self.label,
                                 residual=part.residual(f"{self.label} (hop 3)", self.mine,
                                                        part.replicate))
            if self.full.data_ptr() != self.t.data_ptr():
                self.t.copy_(self.full.narrow(0, 0, self.t.numel()))
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class QuantizedHybridReduce(_QuantizedShardHop, HybridReduce):
    """The gradient-reduce part of a 2-D mesh, quantized on both hops (module docstring)."""

    def _sum_replicas(self, t: torch.Tensor, label: str, async_op: bool) -> Any:
        r, n = self.replicate.world_size, t.numel()
        padded = -(-n // r) * r
        if padded == n and t.is_contiguous():
            full = t
        else:  # hop 2 splits the chunk into R equal parts
            full = torch.zeros(padded, dtype=t.dtype, device=t.device)
            full.narrow(0, 0, n).copy_(t)
        # Hop 2's sums stay in fp32 until hop 3 rounds them into the gradient dtype.
        mine = torch.empty(padded // r, dtype=torch.float32, device=t.device)
        h = quantized_reduce_scatter(self.replicate, mine, full, bits=self.bits,
                                     block=self.block, label=label, async_op=True,
                                     residual=self.residual(f"{label} (hop 2)", full,
                                                            self.replicate))
        hops = _AcrossHops(self, t, full, mine, h, label)
        if not async_op:
            hops.wait()
            return None
        return hops


class _QuantizedGatherHop:
    """The shard group's all-gather as int8 codes on the wire: what both quantized gather
    parts put in place of the plain one."""

    comm: Any

    def __init__(self, mesh: MeshInfo, bits: int) -> None:
        super().__init__(mesh)  # type: ignore[call-arg]
        self.bits, self.block = bits, wire_block(bits)

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor, label: str,
                    async_op: bool) -> Any:
        return quantized_all_gather(self.comm, out, shard, bits=self.bits, block=self.block,
                                    label=label, async_op=async_op)


class QuantizedFlatGather(_QuantizedGatherHop, FlatGather):
    """The parameter-gather part of a flat group, int8 on the wire."""


class QuantizedHybridGather(_QuantizedGatherHop, HybridGather):
    """The parameter-gather part of a 2-D mesh, int8 on the wire (within the shard group)."""


def quantized_reduce_part(mesh: MeshInfo, dtype: torch.dtype | None, bits: int,
                          feedback: bool = False) -> FlatReduce:
    """The quantized gradient-reduce part of ``mesh``'s layout (``bits``: 8 or 4;
    ``feedback``: error feedback)."""
    cls = QuantizedHybridReduce if mesh.hybrid else QuantizedFlatReduce
    return cls(mesh, dtype, bits, feedback)


def quantized_gather_part(mesh: MeshInfo, bits: int) -> FlatGather:
    """The quantized parameter-gather part of ``mesh``'s layout (``bits``: 8)."""
    cls = QuantizedHybridGather if mesh.hybrid else QuantizedFlatGather
    return cls(mesh, bits)

