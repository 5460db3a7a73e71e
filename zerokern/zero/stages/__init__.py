"""One engine per ZeRO stage (see base.py for the verbs they share)."""

from .base import Engine, Run
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3 import Stage3

ENGINES: dict[int, type[Engine]] = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}

__all__ = ["ENGINES", "Engine", "Run", "Stage0", "Stage1", "Stage2", "Stage3"]
