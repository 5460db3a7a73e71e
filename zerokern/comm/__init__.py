from .collectives import Comm, CommStats

__all__ = ["Comm", "CommStats"]
