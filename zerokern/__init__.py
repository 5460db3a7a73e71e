"""zerokern: ZeRO stages 1-3 for PyTorch with fused mixed-precision AdamW kernels."""

from . import ops
from ._native import has_cuda_kernels, has_native
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .comm import CollectiveError, CollectiveTimeout
from .compose import parallelize, shard_for
from .memory import Arena, ArenaOutOfMemory, Block
from .zero import ZeroAdamW, ZeroConfig, ZeroOptimizer, full_state_dict, shard_model

__version__ = "0.1.0"

__all__ = [
    "Arena",
    "ArenaOutOfMemory",
    "Block",
    "CheckpointError",
    "CollectiveError",
    "CollectiveTimeout",
    "ZeroAdamW",
    "ZeroConfig",
    "ZeroOptimizer",
    "full_state_dict",
    "shard_model",
    "__version__",
    "has_cuda_kernels",
    "has_native",
    "load_checkpoint",
    "ops",
    "parallelize",
    "save_checkpoint",
    "shard_for",
]
