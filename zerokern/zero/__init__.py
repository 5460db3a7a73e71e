from . import interop
from .any_optimizer import ZeroOptimizer
from .config import ZeroConfig
from .optimizer import ZeroAdamW
from .shard import full_state_dict, shard_model

# torch.nn.utils.clip_grad_norm_ on ZeroAdamW's parameters clips by the global norm
# (interop.py says why); every other call is torch's own.
interop.install()

__all__ = ["ZeroAdamW", "ZeroConfig", "ZeroOptimizer", "full_state_dict", "shard_model"]
