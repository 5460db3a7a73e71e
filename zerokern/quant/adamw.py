"""One AdamW step with compressed optimizer state, in pure PyTorch: the oracle of issue 27.

Every fused backend (C++, CUDA, Triton) that runs ``moments="bf16" | "int8"`` or
``master="none"`` must produce exactly what :func:`adamw_compressed_step_reference_` produces,
bit for bit. It steps the local elements ``[start, start + n)`` of ONE parameter whose whole
(global) element space has ``total_numel`` elements, so a shard's step equals the same
elements' step in the whole parameter (the tests check it).

**The update** is always the fused kernels' fp32 AdamW (the rounding contract of
csrc/kernels.h, spelled exactly in ``zerokern.quant.contract``) with the scalars of
``zerokern.kernel_contract.adam_scalars``, so ``moments="fp32", master="fp32"`` is today's
``cpu`` kernel bit for bit. bf16 moments and int8 format version 3 take the same formula
with ``kernel_contract.fold_bias_correction``'s scalars (``v``'s bias correction folded into
``step_size`` and ``eps``: one division less per element, equal to AdamW in exact
arithmetic). Only what goes in and out of it changes (the range oracle
``zerokern.ops.adamw_compressed`` does the work; this function is one parameter's view):

* ``moments="fp32"``: the moments are updated in place, as today.
* ``moments="bf16"``: both moments are widened to fp32 (exact), updated (folded scalars),
  and stored back rounded to nearest even (``Tensor.copy_`` into bf16).
* ``moments="int8"``: uint8 codes with one fp32 absmax per block of 256 elements
  (``zerokern.quant.maps``), the signed map for ``exp_avg`` and the unsigned one for
  ``exp_avg_sq``. Dequantized to fp32, updated, requantized, in the same call. Blocks are
  counted in the parameter's global element space, so ``start`` must be a multiple of 256
  and the shard must end on a block boundary or at the parameter's end (else ValueError):
  then the shard's local blocks are exactly its global blocks.
* A parameter with fewer than :data:`MIN_COMPRESSED_NUMEL` elements IN TOTAL keeps fp32
  moments whatever was asked (:func:`effective_moments_format`): decided on ``total_numel``,
  never on the shard, so the format does not depend on world size, stage or layout.

**The parameter.** ``master="fp32"``: the update runs on the fp32 master and the optional
16-bit copy is written rounded to nearest even (as today). ``master="none"`` (bf16
parameters only): the bf16 parameter is widened to fp32 (exact), updated, and written back
with ``stochastic_round_bf16(p, sr_bits16(seed, step, global index))``, so its bits depend on
(seed, step, element) only, never on the shard or the backend.

**The int8 format's limit** (the anchors' maps have it too): the unsigned map's smallest
nonzero value is about 3.25e-7, so an ``exp_avg_sq`` below about 1.6e-7 of its block's absmax
(a gradient under about 4e-4 of the block's largest) decodes to 0, while its ``exp_avg``
(proportional to the gradient, not its square) keeps a nonzero code; the next step then
divides by ``eps`` alone and moves that element far. Faithful training needs the gradients
within a block to stay within about three decades of each other (see the quadratic test).

**Non-finite gradients.** The optimizer skips a step whose gradients hold NaN/inf (loss
scaler) before calling this. If called anyway, the fp32 update propagates them as AdamW does;
with int8 moments the affected blocks then decode to NaN (see ``maps``' docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernel_contract import AdamScalars, fold_bias_correction, folds_bias_correction
from .maps import (
    BLOCK,
    SIGNED_MAP_ID,
    UNSIGNED_MAP_ID,
    code_map,
    dequantize_blockwise,
    versioned_map_id,
)

MOMENT_FORMATS = ("fp32", "bf16", "int8")
"""The accepted ``moments=`` names."""

MASTER_MODES = ("fp32", "none")
"""The accepted ``master=`` names."""

INT8_FORMATS = (2, 3)
"""The int8 moment encodings a new state can be created with (``ZeroAdamW(int8_format=)``):
2 (``zerokern.quant.blockwise``, the dynamic maps) and 3 (``zerokern.quant.fmt_v3``, computed
maps). Version 1 states load and step as version 2."""

DEFAULT_INT8_FORMAT = 2
"""The int8 format version new states use when ``int8_format`` is not given, and that this
module's oracle steps by default: the ONE constant that moves the project to version 3, once
every backend (``zerokern.ops.adamw_compressed.V3_BACKENDS``) runs it."""

MIN_COMPRESSED_NUMEL = 4096
"""Parameters with fewer elements than this (in total) keep fp32 moments."""

_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}


def _check_name(arg: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{arg} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def check_int8_format(value: object, arg: str = "int8_format") -> int:
    """``value`` if it is one of :data:`INT8_FORMATS` (an int, not a bool), else ValueError
    naming ``arg``."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in INT8_FORMATS:
        raise ValueError(f"{arg} must be one of {', '.join(map(str, INT8_FORMATS))} (the int8 "
                         f"moments' format version), got {value!r}")
    return value


def effective_moments_format(moments: str, total_numel: int) -> str:
    """The format a parameter's moments are actually stored in.

    Args:
        moments: the requested format, one of :data:`MOMENT_FORMATS`.
        total_numel: the WHOLE parameter's element count (not a shard's).

    Returns:
        ``moments``, or ``"fp32"`` when ``total_numel < MIN_COMPRESSED_NUMEL``.

    Raises:
        ValueError: an unknown ``moments`` name or a negative ``total_numel``.
    """
    _check_name("moments", moments, MOMENT_FORMATS)
    if isinstance(total_numel, bool) or not isinstance(total_numel, int) or total_numel < 0:
        raise ValueError(f"total_numel must be a non-negative int, got {total_numel!r}")
    return "fp32" if total_numel < MIN_COMPRESSED_NUMEL else moments


@dataclass
class CompressedMoments:
    """One shard's Adam moments as stored (updated in place by the step).

    Attributes:
        exp_avg: fp32, bf16 or uint8 codes (signed map), one per local element.
        exp_avg_sq: same dtype as ``exp_avg`` (uint8 codes use the unsigned map).
        exp_avg_absmax: int8 only: fp32, one per 256-block of the shard, else None.
        exp_avg_sq_absmax: int8 only: as ``exp_avg_absmax``, for ``exp_avg_sq``.
    """

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_absmax: torch.Tensor | None = None
    exp_avg_sq_absmax: torch.Tensor | None = None


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def init_compressed_moments(
    moments: str, total_numel: int, n: int, device: torch.device | str | None = None
) -> CompressedMoments:
    """Zero moments for ``n`` local elements of a parameter of ``total_numel`` elements.

    Args:
        moments: the requested format (the effective one is used, see
            :func:`effective_moments_format`).
        total_numel: the whole parameter's element count.
        n: the shard's element count.
        device: where to allocate (default CPU).

    Returns:
        A :class:`CompressedMoments` in the effective format; all-zero codes with zero absmax
        decode to exact zeros, like torch's zero-initialized moments.
    """
    fmt = effective_moments_format(moments, total_numel)
    dtype = _STORAGE[fmt]
    state = CompressedMoments(torch.zeros(n, dtype=dtype, device=device),
                              torch.zeros(n, dtype=dtype, device=device))
    if fmt == "int8":
        state.exp_avg_absmax = torch.zeros(_blocks(n), dtype=torch.float32, device=device)
        state.exp_avg_sq_absmax = torch.zeros(_blocks(n), dtype=torch.float32, device=device)
    return state


def dequantize_moments(state: CompressedMoments, format_version: int = DEFAULT_INT8_FORMAT,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 values of ``state``'s moments (new tensors), in any format.

    Args:
        state: moments as stored.
        format_version: int8 only: the encoding of the codes (1 and 2 decode alike, 3 on
            version 3's maps).

    Returns:
        ``(exp_avg, exp_avg_sq)`` as 1-D fp32 tensors.
    """
    if state.exp_avg.dtype == torch.uint8:
        if state.exp_avg_absmax is None or state.exp_avg_sq_absmax is None:
            raise ValueError("state: int8 moments need exp_avg_absmax and exp_avg_sq_absmax")
        device = state.exp_avg.device
        version = 2 if format_version == 1 else check_int8_format(format_version,
                                                                   "format_version")
        return (
            dequantize_blockwise(state.exp_avg.reshape(-1), state.exp_avg_absmax,
                                 code_map(versioned_map_id(SIGNED_MAP_ID, version), device)),
            dequantize_blockwise(state.exp_avg_sq.reshape(-1), state.exp_avg_sq_absmax,
                                 code_map(versioned_map_id(UNSIGNED_MAP_ID, version), device)),
        )
    # .float() of fp32 returns the tensor itself: clone so the result is always new.
    return (state.exp_avg.reshape(-1).float().clone(),
            state.exp_avg_sq.reshape(-1).float().clone())


def _flat(arg: str, t: torch.Tensor, n: int) -> torch.Tensor:
    if t.numel() != n:
        raise ValueError(f"{arg} has {t.numel()} elements, the shard has {n}")
    if not t.is_contiguous():
        raise ValueError(f"{arg} must be contiguous (it is updated in place)")
    return t.view(-1)


def _check_state(state: CompressedMoments, fmt: str, n: int) -> None:
    dtype = _STORAGE[fmt]
    for name in ("exp_avg", "exp_avg_sq"):
        t = getattr(state, name)
        if t.dtype != dtype:
            raise ValueError(f"state.{name} must be {dtype} for {fmt} moments, got {t.dtype}")
        _flat(f"state.{name}", t, n)
    for name in ("exp_avg_absmax", "exp_avg_sq_absmax"):
        a = getattr(state, name)
        if fmt != "int8":
            if a is not None:
                raise ValueError(f"state.{name} must be None for {fmt} moments")
        elif a is None or a.dtype != torch.float32 or a.numel() != _blocks(n):
            raise ValueError(f"state.{name} must be fp32 with {_blocks(n)} values")


def _check_shard(start: int, n: int, total_numel: int, fmt: str) -> None:
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")
    if start + n > total_numel:
        raise ValueError(f"start + n = {start + n} exceeds total_numel = {total_numel}")
    if fmt != "int8":
        return  # only int8 has blocks; other formats are elementwise
    if start % BLOCK:
        raise ValueError(f"start = {start} is not on a {BLOCK}-element block boundary "
                         f"(int8 moments: pad the layout so shards hold whole blocks)")
    end = start + n
    if end % BLOCK and end != total_numel:
        raise ValueError(f"param: the shard [start, start + n) = [{start}, {end}) ends inside "
                         f"a {BLOCK}-element block (int8 moments need whole blocks)")


def adamw_compressed_step_reference_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: CompressedMoments,
    scalars: AdamScalars,
    *,
    moments: str,
    master: str,
    total_numel: int,
    start: int = 0,
    param_lp: torch.Tensor | None = None,
    seed: int | None = None,
    step: int | None = None,
    format_version: int = DEFAULT_INT8_FORMAT,
) -> None:
    """One AdamW step over elements ``[start, start + n)`` of one parameter, in place.

    Args:
        param: the shard's ``n`` elements: the fp32 master with ``master="fp32"``, the bf16
            parameter with ``master="none"``. Contiguous; updated in place.
        grad: ``n`` gradient elements, any float dtype (widened to fp32; the grad scale is in
            ``scalars``).
        state: the shard's moments in the effective format (see
            :func:`init_compressed_moments`); updated in place.
        scalars: ``zerokern.kernel_contract.adam_scalars(...)`` of this step.
        moments: the requested format, one of :data:`MOMENT_FORMATS`.
        master: ``"fp32"`` or ``"none"``.
        total_numel: the whole parameter's element count: decides the effective format
            and where the last (partial) block ends.
        start: the shard's first element in the parameter's global element space.
        param_lp: ``master="fp32"`` only: the 16-bit parameter copy, written rounded to
            nearest even (None: no copy).
        seed: ``master="none"`` only: the run's seed for ``sr_bits16``, in [0, 2**64).
        step: ``master="none"`` only: the optimizer step for ``sr_bits16``, in [0, 2**32).
        format_version: int8 only: the encoding the codes are read and written with, one of
            :data:`INT8_FORMATS` (default :data:`DEFAULT_INT8_FORMAT`).

    Raises:
        ValueError: naming the bad argument: an unknown ``moments`` or ``master`` name,
            ``master="none"`` with a non-bf16 ``param`` or without ``seed``/``step``, a
            ``param_lp`` with ``master="none"``, a non-fp32 master, a shard outside the
            parameter or (int8) not on block boundaries, or a ``state`` that does not match
            the effective format.
    """
    fmt = effective_moments_format(moments, total_numel)
    _check_name("master", master, MASTER_MODES)
    check_int8_format(format_version, "format_version")
    n = param.numel()
    _check_shard(start, n, total_numel, fmt)
    _check_state(state, fmt, n)
    p = _flat("param", param, n)
    g = _flat("grad", grad, n)
    if master == "fp32":
        if p.dtype != torch.float32:
            raise ValueError(f"param must be the fp32 master with master='fp32', got {p.dtype}")
        lp = None if param_lp is None else _flat("param_lp", param_lp, n)
    else:
        lp = None
        if p.dtype != torch.bfloat16:
            raise ValueError(f"master='none' needs a bf16 param, got {p.dtype}")
        if param_lp is not None:
            raise ValueError("param_lp must be None with master='none' (param is the bf16 copy)")
        if seed is None or step is None:
            raise ValueError("master='none' needs seed and step (the stochastic rounding key)")

    # The range oracle steps it: the shard's blocks are the parameter's own (start is on a
    # block boundary for int8), and element i's index in the parameter is start + i.
    from ..ops.adamw_compressed import adamw_compressed_torch_

    if folds_bias_correction(fmt, format_version):
        scalars = fold_bias_correction(scalars)  # bf16 and version 3 (fold_bias_correction)
    sr_index = None
    if master == "none":
        assert seed is not None and step is not None
        sr_index = start + BLOCK * torch.arange(_blocks(n), dtype=torch.int64, device=p.device)
    adamw_compressed_torch_(
        p, g, state.exp_avg.view(-1), state.exp_avg_sq.view(-1), state.exp_avg_absmax,
        state.exp_avg_sq_absmax, lp, sr_index, 0 if seed is None else seed,
        0 if step is None else step, scalars, format_version)
