"""Update rules (issue 36): ``UpdateRule`` and its registry (base.py), ``AdamWRule``
(adamw.py, the rule of ZeroAdamW), ``TorchClassRule`` (torch_class.py: a torch optimizer
class's own step over the flat shard) and which classes are element-wise (elementwise.py)."""

from .adamw import ADAMW, AdamWRule
from .base import RULES, RangeStep, TorchRule, UpdateRule, get_rule, register_rule
from .torch_class import TorchClassRule

__all__ = ["ADAMW", "RULES", "AdamWRule", "RangeStep", "TorchRule", "TorchClassRule", "UpdateRule",
           "get_rule", "register_rule"]
