"""Argument checks shared by the ops. They run before any kernel, so a bad call raises a
TypeError or ValueError that names the argument and leaves every tensor untouched."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOW_DTYPES = (torch.bfloat16, torch.float16)


def check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_flat(
    x: object,
    name: str,
    *,
    dtypes: tuple[torch.dtype, ...],
    numel: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    t = check_tensor(x, name)
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}; got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (a flat shard), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel} (same as param)")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (same as param)")
    return t


def check_real(
    value: object,
    name: str,
    *,
    lo: float | None = None,
    lo_open: bool = False,
    hi: float | None = None,
    hi_open: bool = False,
    finite: bool = False,
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if v != v:
        raise ValueError(f"{name} must not be nan")
    if finite and v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {v}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and (v > hi or (hi_open and v == hi)):
        raise ValueError(f"{name} must be {'<' if hi_open else '<='} {hi}, got {v}")
    return v
