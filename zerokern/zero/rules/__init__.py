"""Update rules (issue 36): ``UpdateRule`` and its registry (base.py), ``AdamWRule``
(adamw.py, the rule of ZeroAdamW)."""

from .adamw import ADAMW, AdamWRule
from .base import RULES, RangeStep, TorchRule, UpdateRule, get_rule, register_rule

__all__ = ["ADAMW", "RULES", "AdamWRule", "RangeStep", "TorchRule", "UpdateRule", "get_rule",
           "register_rule"]
