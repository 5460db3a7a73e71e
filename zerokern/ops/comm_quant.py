"""quantize_blocks_ / dequantize_blocks_: symmetric block-wise int8 / int4 codes of a flat
tensor, the codec of the quantized collectives (``zerokern.comm.quantized``, ZeRO++'s qwZ and
qgZ).

The format, the rounding of every step, what inf/NaN/zero/subnormal inputs give and the error
bound are ``zerokern.quant.comm_codec``'s (its module docstring): one fp32 scale ``absmax / L``
per block of ``block`` elements (L = 127 for 8 bits, 7 for 4 bits), codes rounded to nearest
even, a block holding inf or NaN decodes to NaN. Every backend gives the same bytes and the same
values bit for bit.

Backends: ``"triton"`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and
``"torch"`` (the oracle, any device). There is no C++/CUDA kernel: ``"cpu"`` and ``"cuda"``
are refused when asked for by argument; ``$ZEROKERN_BACKEND`` is honoured only when it names
one of the two (another value, set for the other ops, leaves the choice automatic: Triton on
CUDA when installed, else torch).
"""

from __future__ import annotations

import os

import torch

from ..quant import comm_codec
from ..quant.comm_codec import DEFAULT_BLOCK, check_format, payload_nbytes
from ._backend import resolve_backend, triton_available
from ._validate import FLOAT_DTYPES, check_flat

__all__ = ["dequantize_blocks_", "quantize_blocks_"]

_BACKENDS = ("triton", "torch")


def _resolve(backend: str | None, device: torch.device) -> str:
    if backend is None:
        env = os.environ.get("ZEROKERN_BACKEND") or None
        if env in _BACKENDS:
            return resolve_backend(env, device, arg="$ZEROKERN_BACKEND")
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be 'triton', 'torch' or None for the block "
                         f"quantization ops (no C++/CUDA kernel), got {backend!r}")
    return resolve_backend(backend, device)


def _check_segments(segments: object) -> int:
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments must be an int >= 1, got {segments!r}")
    return segments


def _check_payload(payload: object, n: int, segments: int, bits: int, block: int,
                   device: torch.device) -> torch.Tensor:
    want = segments * payload_nbytes(n, bits, block)
    p = check_flat(payload, "payload", dtypes=(torch.uint8,))
    if p.numel() != want:
        raise ValueError(f"payload has {p.numel()} bytes, expected {want} ({segments} x "
                         f"payload_nbytes({n}, bits={bits}, block={block}))")
    if p.device != device:
        raise ValueError(f"payload is on {p.device}, expected {device}")
    if p.data_ptr() % 4:
        raise ValueError("payload must start 4-byte aligned (its fp32 scales are read in place)")
    return p


@torch.library.custom_op("zerokern::quantize_blocks_", mutates_args=("payload",))
def _quantize_op(x: torch.Tensor, payload: torch.Tensor, segments: int, bits: int, block: int,
                 backend: str) -> None:
    if backend == "triton":
        from ..kernels.triton.comm_quant import quantize_triton_

        quantize_triton_(x, payload, segments, bits, block)
    else:
        payload.copy_(comm_codec.quantize(x, segments, bits, block))


@_quantize_op.register_fake
def _(x, payload, segments, bits, block, backend) -> None:
    return None


@torch.library.custom_op("zerokern::dequantize_blocks_", mutates_args=("out",))
def _dequantize_op(payload: torch.Tensor, out: torch.Tensor, segments: int, bits: int,
                   block: int, reduce: bool, backend: str) -> None:
    if backend == "triton":
        from ..kernels.triton.comm_quant import dequantize_triton_

        dequantize_triton_(payload, out, segments, bits, block, reduce)
    else:
        n = out.numel() if reduce else out.numel() // segments
        out.copy_(comm_codec.dequantize(payload, n, segments, bits, block, reduce=reduce,
                                        dtype=out.dtype))


@_dequantize_op.register_fake
def _(payload, out, segments, bits, block, reduce, backend) -> None:
    return None


def quantize_blocks_(x: torch.Tensor, payload: torch.Tensor, *, segments: int = 1,
                     bits: int = 8, block: int = DEFAULT_BLOCK,
                     backend: str | None = None) -> torch.Tensor:
    """Quantize flat ``x``, cut into ``segments`` equal segments, into ``payload``: per
    segment its fp32 block scales, then its codes, padded to a multiple of 4 bytes
    (``zerokern.quant.comm_codec.payload_nbytes``).

    Args:
        x: 1-D contiguous fp32, bf16 or fp16 tensor of ``segments * n`` elements.
        payload: 1-D contiguous uint8 tensor of ``segments * payload_nbytes(n, bits, block)``
            bytes on ``x``'s device, 4-byte aligned; overwritten.
        segments: the number of equal segments of ``x``; blocks restart at each (a rank's
            chunk for each destination rank).
        bits: 8 (codes in [-127, 127]) or 4 (in [-7, 7], two per byte).
        block: elements per block, a power of two in [16, 8192].
        backend: "triton", "torch" or None (automatic).

    Returns:
        ``payload``.

    Raises:
        TypeError: a tensor of the wrong dtype (nothing is written).
        ValueError: a bad shape, size, device, ``bits``, ``block``, ``segments`` or
            ``backend`` (nothing is written).
    """
    bits, block = check_format(bits, block)
    segments = _check_segments(segments)
    x = check_flat(x, "x", dtypes=FLOAT_DTYPES)
    if x.numel() % segments:
        raise ValueError(f"x has {x.numel()} elements, not a multiple of segments={segments}")
    p = _check_payload(payload, x.numel() // segments, segments, bits, block, x.device)
    _quantize_op(x, p, segments, bits, block, _resolve(backend, x.device))
    return p


def dequantize_blocks_(payload: torch.Tensor, out: torch.Tensor, *, segments: int = 1,
                       bits: int = 8, block: int = DEFAULT_BLOCK, reduce: bool = False,
                       backend: str | None = None) -> torch.Tensor:
    """Decode ``segments`` payloads (as :func:`quantize_blocks_` wrote them) into ``out``:
    their values end to end, or with ``reduce`` their sum, accumulated in fp32 in segment
    order and rounded once into ``out``'s dtype. A block whose scale is NaN (it held inf or
    NaN) decodes to NaN.

    Args:
        payload: 1-D contiguous uint8 tensor of ``segments * payload_nbytes(n, bits, block)``
            bytes, 4-byte aligned.
        out: 1-D contiguous fp32, bf16 or fp16 tensor on ``payload``'s device: ``segments * n``
            elements, or ``n`` with ``reduce``; overwritten.
        segments: the number of payloads.
        bits: 8 or 4, as quantized.
        block: elements per block, as quantized.
        reduce: sum the segments instead of writing each.
        backend: "triton", "torch" or None (automatic).

    Returns:
        ``out``.

    Raises:
        TypeError: a tensor of the wrong dtype (nothing is written).
        ValueError: a bad shape, size, device, ``bits``, ``block``, ``segments`` or
            ``backend`` (nothing is written).
    """
    bits, block = check_format(bits, block)
    segments = _check_segments(segments)
    o = check_flat(out, "out", dtypes=FLOAT_DTYPES)
    if not reduce and o.numel() % segments:
        raise ValueError(f"out has {o.numel()} elements, not a multiple of segments={segments}")
    n = o.numel() if reduce else o.numel() // segments
    p = _check_payload(payload, n, segments, bits, block, o.device)
    _dequantize_op(p, o, segments, bits, block, bool(reduce), _resolve(backend, o.device))
    return o
