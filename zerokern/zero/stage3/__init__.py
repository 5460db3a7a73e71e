"""ZeRO stage 3's parameter side: units gathered just in time, reduced as their backward ends.

Start with unit.py: its docstring is the whole step, and ``Unit`` the lifecycle of one unit.
context.py holds what the units share (comm, arenas), runtime.py the hooks that move them,
saved.py autograd's saved tensors, recompute.py activation checkpointing's forwards
in the backward, adopt.py values assigned to released parameters, and
engine.py the optimizer side: the state of this rank's slices, stepped unit by unit.
"""

from .context import UnitContext
from .runtime import Stage3Runtime
from .saved import SavedTensorHooks
from .unit import GradPhase, IllegalTransition, Unit, UnitState

__all__ = ["GradPhase", "IllegalTransition", "SavedTensorHooks", "Stage3Runtime", "Unit",
           "UnitContext", "UnitState"]
