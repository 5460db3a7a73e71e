"""Memory management: a contiguous arena with defragmentation (ZeRO paper §6.3)."""

from zerokern.memory.arena import Arena, ArenaOutOfMemory, Block

__all__ = ["Arena", "ArenaOutOfMemory", "Block"]
