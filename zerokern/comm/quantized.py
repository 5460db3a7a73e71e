"""Quantized collectives on a zerokern :class:`~zerokern.comm.Comm` (ZeRO++: qwZ for the
parameter all-gather, qgZ for the gradient reduce-scatter): fewer bytes on the wire, and never
a silent difference between ranks.

The codec is ``zerokern.ops.quantize_blocks_`` / ``dequantize_blocks_`` (format, rounding and
error bound in ``zerokern.quant.comm_codec``): one fp32 scale per block of ``block`` elements
and int8 (``bits=8``) or int4 (``bits=4``) codes. Blocks are counted from the start of each
rank's piece (its shard, or the chunk bound for one rank), so they never straddle ranks (the
rule of the stored int8 state too: [Note: blocks never straddle shards] in
zerokern/zero/state_format.py).

* :func:`quantized_all_gather` (qwZ): each rank quantizes its shard, the payloads (codes and
  scales) are all-gathered, and every rank decodes every shard, its own included, from the
  gathered bytes. So every rank holds the same values bit for bit.
* :func:`quantized_reduce_scatter` (qgZ): each rank quantizes the chunk of every destination
  rank, an all-to-all delivers them, and each rank decodes the chunks it received and sums them
  in fp32, in rank order (never in 8 or 4 bits), rounding once into ``out``'s dtype.
* :func:`quantized_reduce_scatter_2hop` (qgZ on a 2-D mesh): first within the shard group
  (the fast, intra-node link), then across the replicate group as a quantized reduce-scatter
  and a quantized all-gather, so the slow link carries only codes and scales and the replicas
  end with the same bits.

A block holding inf or NaN decodes to NaN, so a non-finite gradient anywhere still makes the
reduced gradient non-finite and the overflow check trips.

Scratch: the payloads sent and received (and, with error feedback, the fp32 sum of the input
and its residual) are held from the call until the decode; they are counted in the Comm's
``scratch_bytes`` / ``scratch_peak``, which ``memory_stats()`` reports as ``comm_scratch``.

Accounting: the bytes actually moved, scales and padding included, are counted in the Comm's
``CommStats`` under their own kinds (:func:`quantized_kind`: ``"all_gather_q8"``,
``"reduce_scatter_q4"``, ...), with the elements they stand for (as the paper counts a
collective: a gather's output, a reduce-scatter's input) and the matching ``wire`` elements.
Like the plain collectives these count the whole collective tensor: the gathered payloads
(N x P bytes) or the payloads of the input's N chunks. ``zerokern.formulas``'
``quantized_all_gather_bytes`` / ``quantized_reduce_scatter_bytes`` /
``quantized_2hop_bytes`` give the same numbers. With one rank nothing is sent, nothing is
quantized (``out`` is a plain copy) and nothing is counted, as with the plain collectives.

Every rank must call with the same sizes, ``bits`` and ``block``; the arguments are checked
before anything is written or sent.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops._validate import FLOAT_DTYPES, check_flat
from ..ops.comm_quant import dequantize_blocks_, quantize_blocks_
from ..quant.comm_codec import DEFAULT_BLOCK, check_format, payload_nbytes, wire_block
from .collectives import Comm

__all__ = ["QuantizedHandle", "quantized_all_gather", "quantized_kind",
           "quantized_reduce_scatter", "quantized_reduce_scatter_2hop"]


def quantized_kind(op: str, bits: int) -> str:
    """The ``CommStats`` kind of a quantized collective: ``"all_gather_q8"``,
    ``"reduce_scatter_q4"``, ...

    Args:
        op: ``"all_gather"`` or ``"reduce_scatter"``.
        bits: 8 or 4.

    Returns:
        The kind's name.
    """
    if op not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"op must be 'all_gather' or 'reduce_scatter', got {op!r}")
    return f"{op}_q{check_format(bits, DEFAULT_BLOCK)[0]}"


class QuantizedHandle:
    """What an asynchronous quantized collective returns: ``wait()`` waits for the
    collective (as :class:`~zerokern.comm.Handle` does) and then decodes into ``out``, once.
    ``out`` holds the result only after ``wait()``."""

    def __init__(self, handle: Any, finish: Any) -> None:
        self._handle, self._finish, self._done = handle, finish, False

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the collective and decode.

        Args:
            timeout: seconds this rank waits for the others (None: no limit); raises
                ``CollectiveTimeout`` when they run out.

        Returns:
            True.
        """
        if not self._done:
            self._handle.wait(timeout)
            self._finish()
            self._done = True
            self._handle = self._finish = None
        return True

    def is_completed(self) -> bool:
        """Whether ``wait()`` would not block (the data has arrived)."""
        return self._done or self._handle.is_completed()


def _check(comm: Comm, out: object, inp: object, inp_name: str, bits: int, block: int | None,
           gathered: bool) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The arguments checked (``block`` None: ``wire_block(bits)``); ``gathered``: out is N x
    inp (else inp is N x out)."""
    if not isinstance(comm, Comm):
        raise TypeError(f"comm must be a zerokern.comm.Comm, got {type(comm).__name__}")
    bits, block = check_format(bits, wire_block(bits, block))
    o = check_flat(out, "out", dtypes=FLOAT_DTYPES)
    t = check_flat(inp, inp_name, dtypes=FLOAT_DTYPES)
    if t.device != o.device:
        raise ValueError(f"{inp_name} is on {t.device}, out on {o.device}: same device needed")
    big, small = (o, t) if gathered else (t, o)
    if big.numel() != small.numel() * comm.world_size:
        raise ValueError(f"{inp_name} has {t.numel()} elements and out {o.numel()}: "
                         f"{'out' if gathered else inp_name} must hold {comm.world_size} x "
                         f"{'the shard' if gathered else 'out'}")
    return o, t, bits, block


def _with_residual(src: torch.Tensor, residual: torch.Tensor | None,
                   name: str) -> torch.Tensor:
    """Error feedback: what is quantized, ``src`` plus the residual of the last send (fp32);
    ``src`` itself without one."""
    if residual is None:
        return src
    r = check_flat(residual, "residual", dtypes=(torch.float32,))
    if r.numel() != src.numel() or r.device != src.device:
        raise ValueError(f"residual must hold {src.numel()} fp32 elements on {src.device} (as "
                         f"{name}), got {r.numel()} on {r.device}")
    return src.float() + r


def _keep_residual(residual: torch.Tensor | None, x: torch.Tensor, send: torch.Tensor,
                   segments: int, bits: int, block: int, backend: str | None) -> None:
    """``residual`` = ``x`` - its decoding from ``send`` (what was not sent this time, added
    to the next send). A block that held inf or NaN decodes to NaN: its residual is dropped
    (zero), so one overflow step does not poison every later one."""
    if residual is None:
        return
    dequantize_blocks_(send, residual, segments=segments, bits=bits, block=block,
                       backend=backend)
    torch.sub(x, residual, out=residual)
    residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def _take_scratch(comm: Comm, *bufs: torch.Tensor) -> int:
    """Count ``bufs`` (the payloads, the error-feedback sum) in the Comm's scratch bytes, as
    the point-to-point reduce-scatter's receive buffers are (``memory_stats()``'s
    ``comm_scratch``: the most held at once); returns the bytes to give back at the end."""
    n = sum(b.numel() * b.element_size() for b in bufs)
    comm.scratch_bytes += n
    comm.scratch_peak = max(comm.scratch_peak, comm.scratch_bytes)
    return n


def _finish(handle: Any, finish: Any, async_op: bool) -> QuantizedHandle | None:
    h = QuantizedHandle(handle, finish)
    if async_op:
        return h
    h.wait()
    return None


def quantized_all_gather(comm: Comm, out: torch.Tensor, shard: torch.Tensor, *, bits: int = 8,
                         block: int | None = None, label: str = "shard",
                         async_op: bool = False, backend: str | None = None,
                         residual: torch.Tensor | None = None) -> QuantizedHandle | None:
    """``out`` = every rank's ``shard``, in rank order, each decoded from its int8/int4
    codes: the same bits on every rank (qwZ).

    The shard is quantized before this returns, so the caller may reuse it at once (``shard``
    may be this rank's slice of ``out``). Counted as ``quantized_kind("all_gather", bits)``:
    ``out``'s elements, and ``N * payload_nbytes(shard.numel(), bits, block)`` bytes.

    Args:
        comm: the group.
        out: 1-D contiguous fp32/bf16/fp16 tensor of ``N * shard.numel()`` elements.
        shard: 1-D contiguous fp32/bf16/fp16 tensor on ``out``'s device, this rank's part.
        bits: 8 or 4.
        block: elements per quantization block, a power of two in [16, 8192]; None: the
            default of ``bits`` (``zerokern.quant.comm_codec.WIRE_BLOCK``: 256 for 8 bits, 32
            for 4).
        label: what is moved, for error messages.
        async_op: return a :class:`QuantizedHandle` instead of waiting.
        backend: the codec's backend ("triton", "torch" or None: automatic).
        residual: error feedback: an fp32 tensor of ``shard``'s size, added to the shard
            before it is quantized and then set to what the codes missed (a block holding
            inf or NaN leaves zero); None: plain. Untouched with one rank.

    Returns:
        A handle with ``async_op`` (None with one rank: nothing to wait for), else None.

    Raises:
        TypeError, ValueError: bad arguments (nothing is written or sent).
        CollectiveError: the collective failed.
    """
    out, shard, bits, block = _check(comm, out, shard, "shard", bits, block, gathered=True)
    n, world = shard.numel(), comm.world_size
    if world == 1:
        out.copy_(shard)
        return None
    size = payload_nbytes(n, bits, block)
    send = torch.empty(size, dtype=torch.uint8, device=out.device)
    x = _with_residual(shard, residual, "shard")
    quantize_blocks_(x, send, bits=bits, block=block, backend=backend)
    _keep_residual(residual, x, send, 1, bits, block, backend)
    recv = torch.empty(world * size, dtype=torch.uint8, device=out.device)
    held = _take_scratch(comm, send, recv, *((x,) if x is not shard else ()))
    handle = comm.all_gather(recv, send, label, async_op=True, count=False)
    comm.stats.add(quantized_kind("all_gather", bits), world * n, 0, ranks=world,
                   nbytes=recv.numel())

    def finish() -> None:
        dequantize_blocks_(recv, out, segments=world, bits=bits, block=block, backend=backend)
        comm.scratch_bytes -= held

    return _finish(handle, finish, async_op)


def quantized_reduce_scatter(comm: Comm, out: torch.Tensor, full: torch.Tensor, *,
                             bits: int = 8, block: int | None = None, label: str = "bucket",
                             async_op: bool = False, backend: str | None = None,
                             residual: torch.Tensor | None = None) -> QuantizedHandle | None:
    """``out`` = the sum over ranks of chunk ``comm.rank`` of ``full``, each rank's chunk
    decoded from its int8/int4 codes and summed in fp32 in rank order (qgZ).

    Every chunk is quantized before this returns (``out`` may be this rank's chunk of
    ``full``). The result is the oracle's ``dequantize(payloads, reduce=True)`` of the N
    received payloads, bit for bit; its distance to the exact sum is at most the sum of the
    chunks' ``zerokern.quant.comm_codec.error_bound`` plus fp32 summation and the final
    rounding. Counted as ``quantized_kind("reduce_scatter", bits)``: ``full``'s elements, and
    ``N * payload_nbytes(out.numel(), bits, block)`` bytes.

    Args:
        comm: the group.
        out: 1-D contiguous fp32/bf16/fp16 tensor, this rank's chunk of the sum.
        full: 1-D contiguous fp32/bf16/fp16 tensor of ``N * out.numel()`` elements on
            ``out``'s device, this rank's contribution.
        bits: 8 or 4.
        block: elements per quantization block, a power of two in [16, 8192]; None: the
            default of ``bits`` (``zerokern.quant.comm_codec.WIRE_BLOCK``: 256 for 8 bits, 32
            for 4).
        label: what is moved, for error messages.
        async_op: return a :class:`QuantizedHandle` instead of waiting.
        backend: the codec's backend ("triton", "torch" or None: automatic).
        residual: error feedback (LoCo, arXiv 2407.04480): an fp32 tensor of ``full``'s
            size, added to ``full`` before it is quantized and then set to what the codes
            missed, so the next call sends it (a block holding inf or NaN leaves zero);
            None: plain. Untouched with one rank.

    Returns:
        A handle with ``async_op`` (None with one rank), else None.

    Raises:
        TypeError, ValueError: bad arguments (nothing is written or sent).
        CollectiveError: the collective failed.
    """
    out, full, bits, block = _check(comm, out, full, "full", bits, block, gathered=False)
    c, world = out.numel(), comm.world_size
    if world == 1:
        if out.data_ptr() != full.data_ptr() or out.dtype != full.dtype:
            out.copy_(full)
        return None
    size = payload_nbytes(c, bits, block)
    send = torch.empty(world * size, dtype=torch.uint8, device=out.device)
    x = _with_residual(full, residual, "full")
    quantize_blocks_(x, send, segments=world, bits=bits, block=block, backend=backend)
    _keep_residual(residual, x, send, world, bits, block, backend)
    recv = torch.empty_like(send)
    held = _take_scratch(comm, send, recv, *((x,) if x is not full else ()))
    handle = comm.all_to_all(recv, send, label, async_op=True, count=False)
    comm.stats.add(quantized_kind("reduce_scatter", bits), world * c, 0, ranks=world,
                   nbytes=send.numel())

    def finish() -> None:
        dequantize_blocks_(recv, out, segments=world, bits=bits, block=block, reduce=True,
                           backend=backend)
        comm.scratch_bytes -= held

    return _finish(handle, finish, async_op)


def quantized_reduce_scatter_2hop(comm: Comm, out: torch.Tensor, full: torch.Tensor, *,
                                  bits: int = 8, gather_bits: int = 8,
                                  block: int | None = None, label: str = "bucket",
                                  backend: str | None = None) -> None:
    """Hybrid sharding (``comm.replicate`` set, R replicas of S ranks): ``out`` = the sum over
    all R x S ranks of chunk ``comm.rank`` of ``full``, in three quantized hops (qgZ):

    1. :func:`quantized_reduce_scatter` within the shard group (``bits``): an fp32 partial
       sum of this rank's chunk over its S ranks;
    2. :func:`quantized_reduce_scatter` of that partial across the replicate group
       (``bits``): each replica sums 1/R of the chunk over the R replicas, in fp32;
    3. :func:`quantized_all_gather` of those sums across the replicate group
       (``gather_bits``): every replica decodes the same bits.

    The slow (replicate) link carries only codes and scales, each element's once per hop.
    The hops are counted in each dim's own ``CommStats`` (``comm.stats`` and
    ``comm.replicate.stats``). With R = 1 (or no replicate group) only hop 1 runs, into
    ``out``. Synchronous.

    Args:
        comm: the shard group's Comm, with ``replicate`` (zerokern.comm.mesh.mesh_comm).
        out: 1-D contiguous fp32/bf16/fp16 tensor, this rank's chunk; its size a multiple of R.
        full: 1-D contiguous fp32/bf16/fp16 tensor of ``S * out.numel()`` elements.
        bits: 8 or 4, hops 1 and 2 (the gradients).
        gather_bits: 8 or 4, hop 3 (the reduced sums).
        block: elements per quantization block, a power of two in [16, 8192]; None: the
            default of ``bits`` (``zerokern.quant.comm_codec.WIRE_BLOCK``: 256 for 8 bits, 32
            for 4), each hop at its own width's (hops 1-2 ``bits``, hop 3 ``gather_bits``).
        label: what is moved, for error messages.
        backend: the codec's backend ("triton", "torch" or None: automatic).

    Raises:
        TypeError, ValueError: bad arguments (nothing is written or sent).
        CollectiveError: a collective failed.
    """
    given = block
    out, full, bits, block = _check(comm, out, full, "full", bits, block, gathered=False)
    gather_bits, gather_block = check_format(gather_bits, wire_block(gather_bits, given))
    rep = comm.replicate
    r = rep.world_size if rep is not None else 1
    if r == 1:
        quantized_reduce_scatter(comm, out, full, bits=bits, block=block, label=label,
                                 backend=backend)
        return
    if out.numel() % r:
        raise ValueError(f"out has {out.numel()} elements, not a multiple of the {r} "
                         f"replicas (each sums 1/{r} of it across the replicate group)")
    partial = torch.empty(out.numel(), dtype=torch.float32, device=out.device)
    quantized_reduce_scatter(comm, partial, full, bits=bits, block=block, label=label,
                             backend=backend)
    mine = torch.empty(out.numel() // r, dtype=torch.float32, device=out.device)
    across = f"{label} across replicas"
    quantized_reduce_scatter(rep, mine, partial, bits=bits, block=block, label=across,
                             backend=backend)
    quantized_all_gather(rep, out, mine, bits=gather_bits, block=gather_block, label=across,
                         backend=backend)
