"""Public functional ops. Each is a torch.library custom op (usable under torch.compile) with
backends "cuda", "triton", "cpu" and "torch" (the pure-PyTorch reference)."""

from ._backend import available_backends, resolve_backend
from .adamw import fused_adamw_
from .adamw_compressed import fused_adamw_compressed_
from .comm_quant import dequantize_blocks_, quantize_blocks_
from .flatten import flatten_into_, unflatten_from_
from .sq_norm import sq_norm

__all__ = [
    "available_backends",
    "dequantize_blocks_",
    "flatten_into_",
    "fused_adamw_",
    "fused_adamw_compressed_",
    "quantize_blocks_",
    "resolve_backend",
    "sq_norm",
    "unflatten_from_",
]
