"""Pure-Python twin of the native ``zerokern._C.ArenaCore`` (csrc/arena.cpp).

Used when the native module is unavailable (built with ZEROKERN_NO_NATIVE, or not built).
Same interface, same decisions (best fit, lowest offset among equal sizes), same errors, so an
Arena behaves identically on either core; tests/test_arena.py runs both against one model and
against each other.

Thread-safety: every public method holds one lock, so each call is atomic, as in the native
core. Multi-call sequences are the caller's business (zerokern.memory.Arena has its own lock).
"""

from __future__ import annotations

import bisect
import operator
import threading


class ArenaOOMError(MemoryError):
    """No free run is large enough; the core's state is unchanged."""


class _PyArenaCore:
    OOMError = ArenaOOMError

    def __init__(self, capacity_bytes: int, alignment: int = 256) -> None:
        capacity_bytes = operator.index(capacity_bytes)
        alignment = operator.index(alignment)
        if capacity_bytes < 0:
            raise ValueError(f"ArenaCore: capacity_bytes must be >= 0, got {capacity_bytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"ArenaCore: alignment must be a power of two, got {alignment}")
        self._capacity = capacity_bytes
        self._alignment = alignment
        # Free runs, indexed twice like the native core: ascending offsets (+ offset -> size)
        # for finding neighbours to coalesce with, and sorted (size, offset) pairs for best
        # fit. bisect keeps both O(log n) to search (inserts are list shifts, fine here).
        self._free_offsets: list[int] = []
        self._free_size: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        self._live: dict[int, int] = {}  # offset -> reserved size
        self._in_use = 0
        self._peak = 0
        self._num_allocs = 0
        self._num_frees = 0
        self._lock = threading.Lock()
        if capacity_bytes > 0:
            self._add_free(0, capacity_bytes)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    # -- free-run index -------------------------------------------------------------------

    def _add_free(self, offset: int, size: int) -> None:
        bisect.insort(self._free_offsets, offset)
        self._free_size[offset] = size
        bisect.insort(self._by_size, (size, offset))

    def _remove_free(self, offset: int) -> None:
        size = self._free_size.pop(offset)
        del self._free_offsets[bisect.bisect_left(self._free_offsets, offset)]
        del self._by_size[bisect.bisect_left(self._by_size, (size, offset))]

    def _reserved_size(self, nbytes: int) -> int:
        if nbytes > self._capacity:
            return nbytes  # fails anyway
        if nbytes == 0:
            return self._alignment  # zero-byte blocks still get a distinct offset
        a = self._alignment
        return -(-nbytes // a) * a

    # -- public API (mirrors ArenaCore) ---------------------------------------------------

    def alloc(self, nbytes: int) -> int:
        nbytes = operator.index(nbytes)
        with self._lock:
            if nbytes < 0:
                raise ValueError(f"ArenaCore.alloc: nbytes must be >= 0, got {nbytes}")
            need = self._reserved_size(nbytes)
            # (need, -1) sorts before every (need, offset>=0): smallest fitting size first,
            # lowest offset among equals -- the same order as the native std::set.
            i = bisect.bisect_left(self._by_size, (need, -1))
            if i == len(self._by_size):
                raise ArenaOOMError(self._oom_message(nbytes, need))
            size, offset = self._by_size[i]
            self._remove_free(offset)
            if size > need:
                self._add_free(offset + need, size - need)
            self._live[offset] = need
            self._in_use += need
            self._peak = max(self._peak, self._in_use)
            self._num_allocs += 1
            return offset

    def free(self, offset: int) -> None:
        offset = operator.index(offset)
        with self._lock:
            size = self._live.pop(offset, None)
            if size is None:
                i = bisect.bisect_right(self._free_offsets, offset) - 1
                start = self._free_offsets[i] if i >= 0 else 0
                in_free_run = i >= 0 and offset < start + self._free_size[start]
                hint = (
                    " (that address is free: double free?)"
                    if in_free_run
                    else " (not an offset returned by alloc() on this arena)"
                )
                raise ValueError(f"ArenaCore.free: no live block starts at offset {offset}{hint}")
            self._in_use -= size
            self._num_frees += 1
            start = offset
            nxt = start + size
            if nxt in self._free_size:  # run starting right after the block
                size += self._free_size[nxt]
                self._remove_free(nxt)
            i = bisect.bisect_left(self._free_offsets, start) - 1
            if i >= 0:  # run ending right at the block
                prev = self._free_offsets[i]
                if prev + self._free_size[prev] == start:
                    start = prev
                    size += self._free_size[prev]
                    self._remove_free(prev)
            self._add_free(start, size)

    def plan_defragment(self) -> list[tuple[int, int, int]]:
        # Same plan as ArenaCore::plan_defragment; see the comment there for why executing the
        # moves in ascending destination order never clobbers an unmoved block.
        with self._lock:
            moves: list[tuple[int, int, int]] = []
            packed: dict[int, int] = {}
            cursor = 0
            for offset in sorted(self._live):
                size = self._live[offset]
                if offset != cursor:
                    moves.append((offset, cursor, size))
                packed[cursor] = size
                cursor += size
            self._live = packed
            self._free_offsets, self._free_size, self._by_size = [], {}, []
            if cursor < self._capacity:
                self._add_free(cursor, self._capacity - cursor)
            return moves

    def _stats_locked(self) -> dict[str, int | float]:
        free_bytes = self._capacity - self._in_use
        largest = self._by_size[-1][0] if self._by_size else 0
        return {
            "capacity": self._capacity,
            "in_use": self._in_use,
            "peak_in_use": self._peak,
            "live_blocks": len(self._live),
            "free_bytes": free_bytes,
            "largest_free": largest,
            "fragmentation": 0.0 if free_bytes == 0 else 1.0 - largest / free_bytes,
            "num_allocs": self._num_allocs,
            "num_frees": self._num_frees,
        }

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            return self._stats_locked()

    def _oom_message(self, nbytes: int, need: int) -> str:
        s = self._stats_locked()
        return (
            f"arena out of memory: requested {nbytes} bytes ({need} reserved), largest free "
            f"run {s['largest_free']} bytes; capacity {s['capacity']}, in use {s['in_use']}, "
            f"free {s['free_bytes']}, fragmentation {100.0 * s['fragmentation']:.1f}%, "
            f"live blocks {s['live_blocks']}"
        )

    def blocks(self) -> list[tuple[int, int]]:
        with self._lock:
            return sorted(self._live.items())

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._in_use
