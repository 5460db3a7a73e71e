"""Moved to stage3/saved.py; kept for existing imports."""
from .stage3.saved import SavedTensorHooks, _GatheredRef  # noqa: F401
