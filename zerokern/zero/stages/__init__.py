"""One engine per ZeRO stage 0-2 (see base.py for the verbs every stage shares, stage 3's
included: its optimizer side is stage3/engine.py, beside the units it steps). Each composes
this rank's optimizer state (shard_state.py), placed on the device or, with ZeRO-Offload, on
the host; the stage owns only how its buffers hold gradients and parameters, and calls the
communication parts (comm/parts.py) to reduce and gather them.

The registry of all four stages (``make_engine``, ``planned_memory``) is zero/engines.py: this
package names no stage-3 module, so stage3/ may build on it without an import cycle.
"""

from __future__ import annotations

from .base import Engine, Run
from .flat import FlatEngine
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2

__all__ = ["Engine", "FlatEngine", "Run", "Stage0", "Stage1", "Stage2"]
