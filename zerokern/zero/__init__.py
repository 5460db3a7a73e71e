from .optimizer import ZeroAdamW
from .shard import full_state_dict, shard_model

__all__ = ["ZeroAdamW", "full_state_dict", "shard_model"]
