"""sq_norm: sum of squares of a flat fp32/bf16/fp16 tensor as a 0-dim fp32 tensor,
accumulated in fp32 or wider; inf and nan propagate (the overflow check relies on it)."""

from __future__ import annotations

import torch

from .. import _native
from ._backend import resolve_backend
from ._reference import sq_norm_torch
from ._validate import FLOAT_DTYPES, check_flat

__all__ = ["sq_norm"]


@torch.library.custom_op("zerokern::sq_norm", mutates_args=())
def _sq_norm_op(t: torch.Tensor, backend: str) -> torch.Tensor:
    if backend == "torch":
        return sq_norm_torch(t)
    if backend == "triton":
        from ..kernels.triton.sq_norm import sq_norm_triton

        return sq_norm_triton(t)
    return _native.require(backend).sq_norm(t)


@_sq_norm_op.register_fake
def _(t: torch.Tensor, backend: str) -> torch.Tensor:
    return t.new_empty((), dtype=torch.float32)


def sq_norm(t: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """Sum of squares of flat ``t`` (fp32, bf16 or fp16) as a 0-dim fp32 tensor."""
    check_flat(t, "t", dtypes=FLOAT_DTYPES)
    return _sq_norm_op(t, resolve_backend(backend, t.device))
