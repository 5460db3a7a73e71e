"""Moved to the stage3 package (runtime.py, unit.py); kept for existing imports."""
from .stage3 import GradPhase, Stage3Runtime, Unit  # noqa: F401
