from .collectives import CollectiveError, Comm, CommStats, Handle, inflight_count, wait_released

__all__ = ["Comm", "CollectiveError", "CommStats", "Handle", "inflight_count", "wait_released"]
