"""Many (src, dst) copies in one Triton launch: flattening parameters/grads into buckets
and scattering them back.

The host cuts every segment into chunks of at most CHUNK_BYTES and writes one row per
chunk into an int64 table: (src address, dst address, byte count, access width). Program i
reads row i, turns the two addresses into typed pointers (int -> pointer casts) and
copies the chunk with a loop of TILE-element vector accesses. The access width is the
largest of 16 / 4 / 2 / 1 bytes that divides both addresses and the length:

* 16: int32 elements with divisibility hints on the addresses and the count, which gives
  128-bit ld.global.v4 / st.global.v4 accesses;
* 4, 2, 1: int32 / int16 / uint8 elements, one per thread per access, any alignment.

When src and dst are misaligned by the same amount modulo 16 (a sub-range of a tensor
copied into an equally offset place, or the reverse), the segment is split into a short
head, a 16-byte aligned body and a short tail so that the bulk still moves at width 16.

The table lives on the tensors' device (copied from pinned memory without a host sync).
Under TRITON_INTERPRET=1 the interpreter dereferences raw host addresses, so the tensors
must be CPU tensors there (which is what the interpreter tests use).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import check_interpreter

CHUNK_BYTES = 1 << 16  # kCopyChunkBytes in csrc/kernels.h
TILE = 2048  # int32 elements per iteration at width 16: 8 KiB, 4 x 16 B per thread
NUM_WARPS = 4
ROW = 4  # int64 fields per table row


@triton.jit
def _copy_vec(src, dst, count, TILE: tl.constexpr):
    """count elements; src/dst 16-byte aligned and count a multiple of 16 bytes."""
    offs = tl.arange(0, TILE)
    n_full = count // TILE
    for t in range(0, n_full):
        idx = t * TILE + offs
        tl.store(dst + idx, tl.load(src + idx))
    idx = n_full * TILE + offs
    mask = idx < count
    tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


@triton.jit
def _copy_scalar(src, dst, count, SUB: tl.constexpr):
    """count elements, no alignment known. SUB = one element per thread: the load and the
    store then share one layout (no shared-memory layout conversion); four independent
    sub-tiles per iteration keep several loads in flight per thread."""
    offs = tl.arange(0, SUB)
    for t in range(0, tl.cdiv(count, 4 * SUB)):
        i0 = t * (4 * SUB) + offs
        i1 = i0 + SUB
        i2 = i1 + SUB
        i3 = i2 + SUB
        x0 = tl.load(src + i0, mask=i0 < count)
        x1 = tl.load(src + i1, mask=i1 < count)
        x2 = tl.load(src + i2, mask=i2 < count)
        x3 = tl.load(src + i3, mask=i3 < count)
        tl.store(dst + i0, x0, mask=i0 < count)
        tl.store(dst + i1, x1, mask=i1 < count)
        tl.store(dst + i2, x2, mask=i2 < count)
        tl.store(dst + i3, x3, mask=i3 < count)


@triton.jit
def copy_chunks_kernel(table_ptr, TILE: tl.constexpr, SUB: tl.constexpr):
    row = table_ptr + tl.program_id(0).to(tl.int64) * 4
    src_addr = tl.load(row)
    dst_addr = tl.load(row + 1)
    nbytes = tl.load(row + 2).to(tl.int32)  # <= CHUNK_BYTES
    width = tl.load(row + 3).to(tl.int32)
    # (No variables assigned inside the branches: Triton merges them across branches and
    # requires one type, so each branch builds its typed pointers inline. The alignment
    # hint goes on the pointer: it does not propagate through the int -> pointer cast.)
    if width == 16:
        _copy_vec(
            tl.multiple_of(src_addr.to(tl.pointer_type(tl.int32)), 16),
            tl.multiple_of(dst_addr.to(tl.pointer_type(tl.int32)), 16),
            tl.multiple_of(nbytes // 4, 4),
            TILE,
        )
    elif width == 4:
        _copy_scalar(
            src_addr.to(tl.pointer_type(tl.int32)),
            dst_addr.to(tl.pointer_type(tl.int32)),
            nbytes // 4,
            SUB,
        )
    elif width == 2:
        _copy_scalar(
            src_addr.to(tl.pointer_type(tl.int16)),
            dst_addr.to(tl.pointer_type(tl.int16)),
            nbytes // 2,
            SUB,
        )
    else:
        _copy_scalar(
            src_addr.to(tl.pointer_type(tl.uint8)),
            dst_addr.to(tl.pointer_type(tl.uint8)),
            nbytes,
            SUB,
        )


# Under TRITON_INTERPRET=1 (read when triton.jit runs) the kernel is an InterpretedFunction.
_INTERPRETED = type(copy_chunks_kernel).__name__ == "InterpretedFunction"


def _width(src: int, dst: int, nbytes: int) -> int:
    x = src | dst | nbytes
    for w in (16, 4, 2):
        if x % w == 0:
            return w
    return 1


def _add_rows(rows: list[int], src: int, dst: int, nbytes: int) -> None:
    """Append the rows of one contiguous copy (any size, any alignment)."""

    def pieces(s: int, d: int, b: int) -> None:
        w = _width(s, d, b)
        for off in range(0, b, CHUNK_BYTES):
            rows.extend((s + off, d + off, min(CHUNK_BYTES, b - off), w))

    if nbytes == 0:
        return
    mis = src % 16
    if mis != 0 and mis == dst % 16 and nbytes >= 16 + (16 - mis):
        head = 16 - mis
        body = (nbytes - head) & ~15
        pieces(src, dst, head)
        pieces(src + head, dst + head, body)
        pieces(src + head + body, dst + head + body, nbytes - head - body)
    elif mis == 0 and dst % 16 == 0 and nbytes % 16 != 0 and nbytes > 16:
        body = nbytes & ~15
        pieces(src, dst, body)
        pieces(src + body, dst + body, nbytes - body)
    else:
        pieces(src, dst, nbytes)


def build_table(segments: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Flat list of ROW ints per chunk; validates the (src, dst) pairs."""
    rows: list[int] = []
    for src, dst in segments:
        if src.dtype != dst.dtype or src.numel() != dst.numel():
            raise ValueError(
                f"copy_segments: src {src.dtype}[{src.numel()}] vs dst {dst.dtype}[{dst.numel()}]"
            )
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("copy_segments: src and dst must be contiguous views")
        _add_rows(rows, src.data_ptr(), dst.data_ptr(), src.numel() * src.element_size())
    return rows


def copy_segments_triton(segments: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for every (src, dst) pair, in a single kernel launch."""
    check_interpreter()
    if not segments:
        return
    device = segments[0][1].device
    for src, dst in segments:
        if src.device != device or dst.device != device:
            raise ValueError("copy_segments: all tensors must be on one device")
    if device.type != "cpu" and _INTERPRETED:
        raise RuntimeError("copy_segments_triton under TRITON_INTERPRET=1 needs CPU tensors")
    rows = build_table(segments)
    if not rows:
        return
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type != "cpu":
        table = table.pin_memory().to(device, non_blocking=True)
    copy_chunks_kernel[(len(rows) // ROW,)](
        table, TILE=TILE, SUB=32 * NUM_WARPS, num_warps=NUM_WARPS
    )
