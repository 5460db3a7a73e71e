"""flatten_into_ / unflatten_from_: many tensors into one flat buffer (a gradient bucket)
and back, in one kernel launch.

Each tensor i contributes elements ``[start_i, start_i + length_i)`` of its flattened self
(default: all of it), placed at ``offsets[i]`` in the flat buffer (default: packed from 0).
A range that covers only part of a tensor is how a parameter is split across two buckets.

With the native backends (``cpu``, ``cuda``) a call goes straight to ``_C.copy_flat``, which
checks the arguments and computes every piece's address in C++: no Python view and no Python
check per tensor, which for thousands of small tensors cost 10x the copy itself. The torch and
triton backends, and every call under torch.compile, go through the custom ops below (views
built in Python, checks in `_plan`); both paths raise the same errors with the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _native
from ._backend import resolve_backend
from ._reference import copy_segments_torch
from ._validate import check_flat, check_tensor

__all__ = ["flatten_into_", "unflatten_from_"]

_NATIVE = ("cpu", "cuda")


def _copy(srcs: list[torch.Tensor], dsts: list[torch.Tensor], backend: str) -> None:
    if backend == "torch":
        copy_segments_torch(list(zip(srcs, dsts, strict=True)))
    elif backend == "triton":
        from ..kernels.triton.flatten import copy_segments_triton

        copy_segments_triton(list(zip(srcs, dsts, strict=True)))
    else:
        _native.require(backend).copy_segments(srcs, dsts)


def _views(tensors, flat, offsets, starts, lengths):
    pieces = [
        t.reshape(-1).narrow(0, s, n) for t, s, n in zip(tensors, starts, lengths, strict=True)
    ]
    slots = [flat.narrow(0, o, n) for o, n in zip(offsets, lengths, strict=True)]
    return pieces, slots


@torch.library.custom_op("zerokern::flatten_into_", mutates_args=("out",))
def _flatten_op(
    tensors: list[torch.Tensor],
    out: torch.Tensor,
    offsets: list[int],
    starts: list[int],
    lengths: list[int],
    backend: str,
) -> None:
    if backend in _NATIVE and _native.require(backend).copy_flat(
        tensors, out, "out", offsets, starts, lengths, True
    ):
        return
    pieces, slots = _views(tensors, out, offsets, starts, lengths)
    _copy(pieces, slots, backend)


@_flatten_op.register_fake
def _(tensors, out, offsets, starts, lengths, backend) -> None:
    return None


@torch.library.custom_op("zerokern::unflatten_from_", mutates_args=("tensors",))
def _unflatten_op(
    flat: torch.Tensor,
    tensors: list[torch.Tensor],
    offsets: list[int],
    starts: list[int],
    lengths: list[int],
    backend: str,
) -> None:
    if backend in _NATIVE and _native.require(backend).copy_flat(
        tensors, flat, "flat", offsets, starts, lengths, False
    ):
        return
    pieces, slots = _views(tensors, flat, offsets, starts, lengths)
    _copy(slots, pieces, backend)


@_unflatten_op.register_fake
def _(flat, tensors, offsets, starts, lengths, backend) -> None:
    return None


def _check_head(tensors: object, flat: torch.Tensor, flat_name: str) -> None:
    check_flat(flat, flat_name, dtypes=(flat.dtype,) if isinstance(flat, torch.Tensor) else ())
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError("tensors must be a sequence of tensors")


def _native_call(
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    flat_name: str,
    offsets: Sequence[int] | None,
    ranges: Sequence[tuple[int, int]] | None,
    backend: str | None,
    to_flat: bool,
) -> tuple[list[torch.Tensor], str | None]:
    """The native path: (tensors as a list, None) once the copy is done in C++, or
    (tensors, the backend) for the custom op when the backend is not native, torch.compile is
    tracing, a dispatch mode is active or a tensor is a subclass (the op is what they see)."""
    _check_head(tensors, flat, flat_name)
    b = resolve_backend(backend, flat.device)
    ts = list(tensors)
    # A tracer or a dispatch mode (FakeTensorMode, FlopCounterMode) must see the op itself.
    if b not in _NATIVE or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return ts, b
    starts = lengths = None
    if ranges is not None:
        starts, lengths = [int(r[0]) for r in ranges], [int(r[1]) for r in ranges]
    offs = None if offsets is None else list(map(int, offsets))
    if _native.require(b).copy_flat(ts, flat, flat_name, offs, starts, lengths, to_flat):
        return ts, None
    return ts, b  # a tensor subclass: the custom op dispatches it


def _plan(
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    flat_name: str,
    offsets: Sequence[int] | None,
    ranges: Sequence[tuple[int, int]] | None,
) -> tuple[list[torch.Tensor], list[int], list[int], list[int]]:
    """Validate everything up front and return (tensors, offsets, starts, lengths).
    _C.copy_flat repeats the checks after `_check_head` in C++, with the same messages."""
    _check_head(tensors, flat, flat_name)
    ts = [check_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    for i, t in enumerate(ts):
        if t.dtype != flat.dtype:
            raise TypeError(f"tensors[{i}] has dtype {t.dtype}, {flat_name} has {flat.dtype}")
        if t.device != flat.device:
            raise ValueError(f"tensors[{i}] is on {t.device}, {flat_name} is on {flat.device}")
        if not t.is_contiguous():
            raise ValueError(f"tensors[{i}] must be contiguous")
    if ranges is None:
        starts, lengths = [0] * len(ts), [t.numel() for t in ts]
    else:
        if len(ranges) != len(ts):
            raise ValueError(f"ranges has {len(ranges)} entries for {len(ts)} tensors")
        starts, lengths = [int(r[0]) for r in ranges], [int(r[1]) for r in ranges]
        for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
            if s < 0 or n < 0 or s + n > ts[i].numel():
                raise ValueError(
                    f"ranges[{i}] = ({s}, {n}) is outside tensors[{i}] ({ts[i].numel()} elements)"
                )
    if offsets is None:
        offs, pos = [], 0
        for n in lengths:
            offs.append(pos)
            pos += n
    else:
        if len(offsets) != len(ts):
            raise ValueError(f"offsets has {len(offsets)} entries for {len(ts)} tensors")
        offs = [int(o) for o in offsets]
    for i, (o, n) in enumerate(zip(offs, lengths, strict=True)):
        if o < 0 or o + n > flat.numel():
            raise ValueError(
                f"offsets[{i}] = {o} with {n} elements does not fit in {flat_name} "
                f"({flat.numel()} elements)"
            )
    # Destinations written in parallel must not overlap.
    spans = sorted((o, o + n, i) for i, (o, n) in enumerate(zip(offs, lengths, strict=True)) if n)
    for (_, e0, i0), (s1, _, i1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"offsets overlap in {flat_name}: tensors[{i0}] and tensors[{i1}]")
    return ts, offs, starts, lengths


def flatten_into_(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor,
    offsets: Sequence[int] | None = None,
    *,
    ranges: Sequence[tuple[int, int]] | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Copy ``tensors`` (or their ``ranges``) into the 1-D ``out`` at ``offsets``; returns out."""
    check_tensor(out, "out")
    _, b = _native_call(tensors, out, "out", offsets, ranges, backend, True)
    if b is None:
        return out
    ts, offs, starts, lengths = _plan(tensors, out, "out", offsets, ranges)
    if ts:
        _flatten_op(ts, out, offs, starts, lengths, b)
    return out


def unflatten_from_(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int] | None = None,
    *,
    ranges: Sequence[tuple[int, int]] | None = None,
    backend: str | None = None,
) -> list[torch.Tensor]:
    """Inverse of flatten_into_: fill ``tensors`` (or their ``ranges``) from ``flat``."""
    check_tensor(flat, "flat")
    native_ts, b = _native_call(tensors, flat, "flat", offsets, ranges, backend, False)
    if b is None:
        return native_ts
    ts, offs, starts, lengths = _plan(tensors, flat, "flat", offsets, ranges)
    if ts:
        _unflatten_op(flat, ts, offs, starts, lengths, b)
    return ts
