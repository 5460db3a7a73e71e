"""One engine per ZeRO stage (see base.py for the verbs they share), and the ZeRO-Offload
variants of stages 1-3 (offload_flat.py, offload3.py)."""

from .base import Engine, Run
from .offload3 import Stage3Offload
from .offload_flat import Stage1Offload, Stage2Offload
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3 import Stage3

ENGINES: dict[int, type[Engine]] = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}
OFFLOAD_ENGINES: dict[int, type[Engine]] = {1: Stage1Offload, 2: Stage2Offload,
                                            3: Stage3Offload}

__all__ = ["ENGINES", "OFFLOAD_ENGINES", "Engine", "Run", "Stage0", "Stage1", "Stage1Offload",
           "Stage2", "Stage2Offload", "Stage3", "Stage3Offload"]
