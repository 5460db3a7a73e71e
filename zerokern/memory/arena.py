"""A contiguous memory arena with explicit defragmentation (ZeRO paper §6.3).

Long training runs interleave long-lived tensors (parameters, gradients, checkpoints) with
short-lived ones; with a general-purpose allocator the holes left by the short-lived ones
fragment memory until a large request fails although enough bytes are free in total. An
``Arena`` pre-allocates one flat byte buffer, hands out aligned views of it, and can compact
all live blocks to its start on demand (``defragment()``), re-pointing every view and every
bound parameter so callers keep working with the same Python objects.

Offset bookkeeping lives in ``zerokern._C.ArenaCore`` when the native module is built, else
in the pure-Python twin ``_PyArenaCore``; both make the same decisions.

Thread-safety: each core call is atomic (the core has its own mutex), and every Arena method
holds the Arena's lock, so ``alloc``/``free``/``defragment`` may be called from several
threads. The lock cannot protect tensors you hold, though: while ``defragment()`` runs, no
other thread may read or write arena memory, since the bytes move underneath it.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from zerokern.memory._arena_py import _PyArenaCore
from zerokern.memory.alias import own_storage

# Overlapping moves (a block sliding down by less than its own size) are copied through a
# temporary; copying in pieces of at most this many bytes keeps the temporary small even for
# huge blocks, which matters precisely when memory is tight enough to need defragmenting.
_COPY_CHUNK_BYTES = 64 << 20

Stats = dict[str, Any]


def _default_core_cls() -> Callable[[int, int], Any]:
    # Imported lazily so that importing zerokern.memory never fails on a broken native build.
    from zerokern._native import _C

    core = getattr(_C, "ArenaCore", None) if _C is not None else None
    return core if core is not None else _PyArenaCore


class ArenaOutOfMemory(MemoryError):
    """No free run of the arena holds the request. The arena is left exactly as it was.

    ``requested_bytes``, ``reserved_bytes`` (after alignment) and ``stats`` (``Arena.stats()``
    at the time of the failure) say why; the message suggests ``defragment()`` when the free
    bytes would suffice if they were contiguous.
    """

    def __init__(
        self,
        message: str,
        *,
        requested_bytes: int | None = None,
        reserved_bytes: int | None = None,
        stats: Stats | None = None,
    ) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.reserved_bytes = reserved_bytes
        self.stats = stats

    @classmethod
    def _from_stats(cls, requested: int, reserved: int, stats: Stats) -> ArenaOutOfMemory:
        s = stats
        msg = (
            f"Arena out of memory: requested {requested} bytes ({reserved} after alignment) "
            f"but the largest free run is {s['largest_free']} bytes "
            f"(capacity {s['capacity']}, in use {s['in_use']} in {s['live_blocks']} blocks, "
            f"free {s['free_bytes']}, largest free run {s['largest_free']}, "
            f"fragmentation {s['fragmentation']:.1%}). "
        )
        if s["free_bytes"] >= reserved:
            msg += (
                "The free bytes would suffice if they were contiguous: call "
                "Arena.defragment() and retry."
            )
        else:
            msg += (
                f"Even defragment() cannot help ({reserved - s['free_bytes']} bytes short): "
                "free blocks or use a larger arena."
            )
        return cls(msg, requested_bytes=requested, reserved_bytes=reserved, stats=dict(s))


class Block:
    """A live allocation: ``numel`` elements of ``dtype`` at byte ``offset`` of its arena.

    ``offset`` and ``tensor`` change when the arena is defragmented; hold on to the Block (or
    to tensors registered with ``bind``), not to ``tensor`` itself or views derived from it.
    """

    __slots__ = ("_arena", "_offset", "_numel", "_dtype", "_tensor", "_bound", "_live")

    def __init__(self, arena: Arena, offset: int, numel: int, dtype: torch.dtype) -> None:
        self._arena = arena
        self._offset = offset
        self._numel = numel
        self._dtype = dtype
        self._live = True
        # Weak references: binding must not keep a parameter alive after its module is gone.
        self._bound: list[weakref.ref[torch.Tensor]] = []
        self._tensor = arena._view(offset, numel, dtype)

    @property
    def arena(self) -> Arena:
        """The arena this block was allocated from."""
        return self._arena

    @property
    def offset(self) -> int:
        """Byte offset in the arena's buffer (changes when the arena is defragmented)."""
        return self._offset

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self._numel

    @property
    def dtype(self) -> torch.dtype:
        """Element dtype."""
        return self._dtype

    @property
    def nbytes(self) -> int:
        """Bytes requested (numel * itemsize); the arena reserves this rounded up."""
        return self._numel * self._dtype.itemsize

    @property
    def is_live(self) -> bool:
        """False once the block has been freed."""
        return self._live

    @property
    def tensor(self) -> torch.Tensor:
        """1-D view of ``numel`` elements into the arena buffer (re-created on defragment)."""
        self._check_live()
        return self._tensor

    def view(self, *shape: int | tuple[int, ...] | list[int] | torch.Size) -> torch.Tensor:
        """``tensor.view(shape)``; like it, accepts ``view(2, 3)`` or ``view((2, 3))``."""
        return self.tensor.view(*shape)

    @property
    def bound(self) -> list[torch.Tensor]:
        """Tensors whose ``.data`` this block keeps pointing at itself (see ``bind``)."""
        alive = [t for t in (r() for r in self._bound) if t is not None]
        return alive

    def bind(self, tensor: torch.Tensor, *, copy: bool = True) -> torch.Tensor:
        """Makes ``tensor.data`` a view of this block with ``tensor``'s shape; returns it.

        The tensor object itself is unchanged (an ``nn.Parameter`` stays the same leaf with
        the same ``requires_grad``, so optimizers and autograd keep working), only its storage
        moves into the arena. With ``copy`` its current values are copied in first. The block
        remembers the tensor and re-points it after every ``defragment()``; binding it to
        another block of the same arena later moves that duty to the new block. Freeing the
        block does not unbind it: the tensor then aliases memory the arena may hand out again,
        so it must not be used afterwards.
        """
        self._check_live()
        if tensor.numel() != self._numel:
            raise ValueError(
                f"cannot bind a tensor of {tensor.numel()} elements to a block of {self._numel}"
            )
        if tensor.dtype != self._dtype:
            raise ValueError(f"cannot bind a {tensor.dtype} tensor to a {self._dtype} block")
        with self._arena._lock:
            view = self._tensor.view(tensor.shape)
            if copy:
                view.copy_(tensor.detach())
            # Its own storage object over the block's bytes: torch.save of the tensor writes
            # its bytes, not the arena's (see alias.py).
            tensor.data = own_storage(view)
            # One owner per tensor, or a later defragment would re-point it to a stale block.
            for other in self._arena._live.values():
                other._bound = [r for r in other._bound if r() is not tensor]
            self._bound.append(weakref.ref(tensor))
        return tensor

    def _check_live(self) -> None:
        if not self._live:
            raise RuntimeError(f"{self!r} has been freed")

    def _relocate(self, offset: int) -> None:
        # Called by Arena.defragment after the bytes have been copied to `offset`.
        self._offset = offset
        self._tensor = self._arena._view(offset, self._numel, self._dtype)
        alive = []
        for ref in self._bound:
            t = ref()
            if t is not None:
                t.data = own_storage(self._tensor.view(t.shape))
                alive.append(ref)
        self._bound = alive

    def __repr__(self) -> str:
        state = "" if self._live else ", freed"
        return (
            f"Block(offset={self._offset}, numel={self._numel}, dtype={self._dtype}, "
            f"nbytes={self.nbytes}{state})"
        )


class Arena:
    """One pre-allocated buffer of ``capacity_bytes`` bytes on ``device`` carved into blocks.

    ``alloc`` is best fit over the free runs with every offset a multiple of ``alignment``
    (a power of two, at least the item size of the dtypes you allocate); ``free`` merges
    neighbouring free runs; ``defragment`` compacts all live blocks to the start.

    Each call is atomic: the core serialises its own calls, and the Arena holds its own
    lock across multi-step sequences (alloc + view creation, the defragment copy + re-point).
    ``core_cls`` injects the bookkeeping class (tests use it to run both cores); by default
    the native ``zerokern._C.ArenaCore`` when available, else ``_PyArenaCore``.
    """

    def __init__(
        self,
        capacity_bytes: int,
        device: str | torch.device = "cpu",
        *,
        alignment: int = 256,
        core_cls: Callable[[int, int], Any] | None = None,
        pin_memory: bool = False,
    ) -> None:
        cls = core_cls if core_cls is not None else _default_core_cls()
        # The core validates capacity and alignment before the buffer is allocated.
        self._core = cls(operator.index(capacity_bytes), operator.index(alignment))
        self._oom_error: type[BaseException] = cls.OOMError
        self._capacity = int(capacity_bytes)
        self._alignment = int(alignment)
        # pin_memory: page-locked host memory (needs CUDA), so copies between it and a GPU
        # are DMA transfers that run asynchronously on a stream (ZeRO-Offload's host arena).
        self._pinned = bool(pin_memory)
        self._buffer = _aligned_buffer(self._capacity, self._alignment, device, self._pinned)
        self._live: dict[int, Block] = {}  # offset -> Block, mirrors the core's live blocks
        # Re-entrant so Block.bind can take it whether or not the caller already holds it.
        self._lock = threading.RLock()

    # -- properties -----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Size of the backing buffer in bytes."""
        return self._capacity

    @property
    def pinned(self) -> bool:
        """Whether the buffer is page-locked host memory."""
        return self._pinned

    @property
    def alignment(self) -> int:
        """Every block's address is a multiple of this many bytes."""
        return self._alignment

    @property
    def device(self) -> torch.device:
        """Device of the backing buffer."""
        return self._buffer.device

    @property
    def buffer(self) -> torch.Tensor:
        """The backing ``uint8`` buffer (for inspection; do not keep views across defragment)."""
        return self._buffer

    @property
    def core(self) -> Any:
        """The bookkeeping object (offsets, free list): ``zerokern._C.ArenaCore`` or the
        pure-Python fallback."""
        return self._core

    @property
    def is_native(self) -> bool:
        """Whether the bookkeeping is the native (C++) core."""
        return not isinstance(self._core, _PyArenaCore)

    # -- allocation -----------------------------------------------------------------------

    def _reserved(self, nbytes: int) -> int:
        a = self._alignment
        return max(-(-nbytes // a) * a, a)

    def _view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        return self._buffer.narrow(0, offset, nbytes).view(dtype)

    def alloc(self, numel: int, dtype: torch.dtype) -> Block:
        """A new block of ``numel`` elements of ``dtype`` (uninitialised contents).

        Raises ``ArenaOutOfMemory``, leaving the arena unchanged, when no free run is large
        enough.
        """
        numel = operator.index(numel)
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        if dtype.itemsize > self._alignment:
            # Both are powers of two, so this is the only way an offset could be misaligned.
            raise ValueError(
                f"alignment {self._alignment} is smaller than the item size of {dtype} "
                f"({dtype.itemsize}); views would be misaligned"
            )
        nbytes = numel * dtype.itemsize
        with self._lock:
            try:
                offset = self._core.alloc(nbytes)
            except self._oom_error:
                raise ArenaOutOfMemory._from_stats(
                    nbytes, self._reserved(nbytes), self._core.stats()
                ) from None
            try:
                block = Block(self, offset, numel, dtype)
            except BaseException:
                self._core.free(offset)  # keep "failure changes nothing" for odd dtypes
                raise
            self._live[offset] = block
            return block

    def free(self, block: Block) -> None:
        """Returns the block's bytes to the arena.

        Raises ValueError for a block of another arena or one already freed. Tensors bound to
        the block or views of it are not invalidated (torch cannot do that) but alias memory
        the arena may reuse: do not use them afterwards.
        """
        if not isinstance(block, Block):
            raise TypeError(f"expected a Block, got {type(block).__name__}")
        with self._lock:
            if block._arena is not self:
                raise ValueError(f"{block!r} belongs to another arena")
            # Identity check: after a double free the offset may already belong to a new block.
            if not block._live or self._live.get(block._offset) is not block:
                raise ValueError(f"{block!r} was already freed (double free)")
            self._core.free(block._offset)
            del self._live[block._offset]
            block._live = False
            block._bound = []

    # -- defragmentation ------------------------------------------------------------------

    def _staging_bytes(self) -> int:
        # Size of the temporary that overlapping moves copy through, predicted from the live
        # blocks (the compaction plan is fully determined by them) so that it is allocated
        # before the core commits the plan: once bookkeeping has changed, the copies must not
        # fail for lack of memory.
        need, cursor = 0, 0
        for offset, size in self._core.blocks():
            if offset != cursor and offset - cursor < size:
                need = max(need, size)
            cursor += size
        return min(need, _COPY_CHUNK_BYTES)

    def defragment(self) -> int:
        """Compacts all live blocks to the start of the buffer; returns the bytes moved.

        Afterwards all free space is one run at the end. Every live Block's ``offset`` and
        ``tensor`` and every bound tensor's ``.data`` are updated to the moved bytes; other
        views taken before (``block.tensor`` results kept around, ``block.view(...)``) are
        stale. On CUDA the copies are enqueued on the current stream.
        """
        with self._lock:
            staging = self._staging_bytes()
            tmp = (
                torch.empty(staging, dtype=torch.uint8, device=self._buffer.device)
                if staging
                else None
            )
            moves = self._core.plan_defragment()
            buf = self._buffer
            moved = 0
            for src, dst, nbytes in moves:
                _move(buf, src, dst, nbytes, tmp)
                moved += nbytes
            relocated = {src: dst for src, dst, _ in moves}
            live: dict[int, Block] = {}
            for offset, block in self._live.items():
                new = relocated.get(offset, offset)
                if new != offset:
                    block._relocate(new)
                live[new] = block
            self._live = live
            return moved

    # -- introspection --------------------------------------------------------------------

    def stats(self) -> Stats:
        """capacity, in_use, peak_in_use, free_bytes, largest_free (bytes, alignment-rounded),
        live_blocks, fragmentation (1 - largest_free / free_bytes), num_allocs, num_frees."""
        return dict(self._core.stats())

    def blocks(self) -> list[Block]:
        """Live blocks in address order."""
        with self._lock:
            return [self._live[off] for off in sorted(self._live)]

    def reset_peak(self) -> None:
        """Restart ``stats()["peak_in_use"]`` from the bytes in use now."""
        self._core.reset_peak()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"Arena(capacity={s['capacity']}, device={self.device}, alignment={self._alignment}, "
            f"in_use={s['in_use']}, peak_in_use={s['peak_in_use']}, "
            f"live_blocks={s['live_blocks']}, largest_free={s['largest_free']}, "
            f"fragmentation={s['fragmentation']:.3f}, "
            f"core={'native' if self.is_native else 'python'})"
        )


def _aligned_buffer(capacity: int, alignment: int, device: str | torch.device,
                    pin_memory: bool = False) -> torch.Tensor:
    """``capacity`` bytes whose first byte's address is a multiple of ``alignment``, so every
    block offset (a multiple of ``alignment``) is aligned in absolute terms too. The CPU
    allocator only guarantees 64 bytes (CUDA's caching allocator 512): allocate
    ``alignment - 1`` spare bytes when the base is not already aligned and narrow."""
    pin = {"pin_memory": True} if pin_memory else {}
    # The storage's size is a whole number of the widest element (16 bytes: complex128), so a
    # view of any dtype into it can be saved and loaded (torch.load checks that a storage
    # record holds whole elements).
    raw = torch.empty(_round_up(capacity, _WIDEST), dtype=torch.uint8, device=device, **pin)
    if raw.data_ptr() % alignment == 0:
        return raw.narrow(0, 0, capacity)
    del raw
    raw = torch.empty(_round_up(capacity + alignment - 1, _WIDEST), dtype=torch.uint8,
                      device=device, **pin)
    skip = -raw.data_ptr() % alignment
    return raw.narrow(0, skip, capacity)


_WIDEST = 16  # bytes of the widest element type (complex128)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _move(buf: torch.Tensor, src: int, dst: int, nbytes: int, tmp: torch.Tensor | None) -> None:
    """Copies buf[src:src+nbytes] to buf[dst:dst+nbytes] (dst < src) with memmove semantics."""
    if src - dst >= nbytes:
        # Disjoint ranges: one direct copy.
        buf.narrow(0, dst, nbytes).copy_(buf.narrow(0, src, nbytes))
        return
    # Overlapping: copy_ between overlapping views is undefined (parallel kernels), so each
    # piece goes through the temporary: tmp = piece.clone(); dst_piece.copy_(tmp). Pieces go
    # in ascending order; piece k writes below dst + end_k <= src + end_k, i.e. only over
    # source bytes that earlier pieces have already read.
    if tmp is None or tmp.numel() == 0:
        tmp = torch.empty(min(nbytes, _COPY_CHUNK_BYTES), dtype=torch.uint8, device=buf.device)
    step = tmp.numel()
    for k in range(0, nbytes, step):
        n = min(step, nbytes - k)
        piece = tmp.narrow(0, 0, n)
        piece.copy_(buf.narrow(0, src + k, n))
        buf.narrow(0, dst + k, n).copy_(piece)
