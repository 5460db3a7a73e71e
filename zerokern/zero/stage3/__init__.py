"""ZeRO stage 3's parameter side: units gathered just in time, reduced as their backward ends.

Start with unit.py: its docstring is the whole step, and ``Unit`` the lifecycle of one unit.
context.py holds what the units share (comm, arenas), runtime.py the hooks that move them,
saved.py autograd's saved tensors, recompute.py activation checkpointing's forwards
in the backward, adopt.py values assigned to released parameters, states.py the
units' transition tables, views.py what the modules see, build.py the units' layout, and
engine.py the optimizer side: the state of this rank's slices, stepped unit by unit.
"""

from .context import UnitContext
from .runtime import Stage3Runtime
from .saved import SavedTensorHooks
from .states import GradPhase, IllegalTransition, UnitState
from .unit import Unit

__all__ = ["GradPhase", "IllegalTransition", "SavedTensorHooks", "Stage3Runtime", "Unit",
           "UnitContext", "UnitState"]
