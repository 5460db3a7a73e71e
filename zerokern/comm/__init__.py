from .collectives import (
    CollectiveError,
    CollectiveTimeout,
    Comm,
    CommStats,
    Handle,
    inflight_count,
    wait_released,
)

__all__ = ["Comm", "CollectiveError", "CollectiveTimeout", "CommStats", "Handle",
           "inflight_count", "wait_released"]
