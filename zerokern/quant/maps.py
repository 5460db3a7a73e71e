"""Dynamic-exponent 8-bit code maps and block-wise quantization: the pure-PyTorch oracle.

Every backend that stores Adam moments in 8 bits (C++, CUDA, Triton) must produce the same
codes and absmax values as :func:`quantize_blockwise`, and the same fp32 values as
:func:`dequantize_blockwise`, bit for bit. So each rounding below is spelled out.

**The maps.** A code map is 256 sorted, distinct fp32 values. Read an 8-bit code as a sign bit
and 7 further bits: the number ``e`` of leading zero bits (0-6) is a decimal exponent, the first
one bit is an indicator, and the ``6 - e`` bits after it are a linear fraction. Its value is
``10**-e`` times the centre of one of ``2**(6-e)`` equal bins that split ``[0.1, 1]``. The
all-zero pattern is 0 and the pattern that would be "minus zero" is +1.0, so the signed map
spans ``[-0.99296875, 1]`` (to fp32 precision) with no -1. The unsigned map has no sign, so that
bit joins the fraction (``2**(7-e)`` bins per exponent), and 0 and 1 complete it. These are the
maps bitsandbytes and torchao use for their 8-bit Adam (``create_dynamic_map``); the tests
compare them bit for bit when those packages are installed. The values are built in pure Python
with each fp32 operation rounded once (round to nearest even), in the order the anchors evaluate
them with ``torch.linspace``: ``step = fl(fl(1 - fl(0.1)) / n)``, bin edge ``b_i = fl(fl(0.1) +
step*i)`` for ``i < (n+1)//2`` and ``fl(1 - step*(n-i))`` above (a fused multiply-add: one
rounding), centre ``fl(fl(b_i + b_(i+1)) / 2)``, value ``fl(fl(10**-e) * centre)``. The built
bytes are pinned by a hash in the tests, so a map id always names the same 256 values.

**Quantize** (``x`` fp32, blocks of ``block`` consecutive elements of the flattened tensor, the
last block partial when the length is not a multiple):

1. ``absmax = max(|x_i|)`` over the block (exact; a NaN-propagating max).
2. ``n_i = x_i / absmax``, one IEEE division rounded to nearest even (a kernel must use a
   correctly rounded division, not a reciprocal multiply). For an all-zero block (absmax 0) the
   divisor is 1, so ``n_i = 0`` and the block decodes to exact zeros.
3. The code is the index of the nearest map value, decided by the 255 fp32 thresholds
   ``t_k = fl((c_k + c_(k+1)) / 2)`` (the exact midpoint, rounded once to nearest even; see
   :func:`decision_thresholds`): ``code = #{k : t_k < n}`` for ``n >= 0`` and
   ``code = #{k : t_k <= n}`` for ``n < 0``. So a value exactly on a threshold goes to the
   code of smaller magnitude (ties toward zero), which keeps the rule sign-symmetric.

**Dequantize**: ``y_i = fl(c[code_i] * absmax)``, one fp32 multiply.

**Error bound.** Let ``v = x_i / absmax`` (exact) lie between codes ``c_k <= v <= c_(k+1)``.
The exact nearest code is at most ``h = (c_(k+1) - c_k) / 2`` away. The fp32 division moves
``n`` by at most ``2**-24 |v|``, the rounded threshold can send a value within half an ulp of a
midpoint to the farther code (at most ``2**-24`` more), and the nearest-code distance is
1-Lipschitz in ``n``, so ``|c[code] - v| <= h + 3 * 2**-24``. The dequantize multiply adds at
most ``2**-24 |y|`` (``2**-150`` in the subnormal range). Altogether
``|y_i - x_i| <= absmax * (h + 2**-22) + 2**-149``, which the tests check in float64. Outside
the map's range (only ``v = -1`` with the signed map, whose lowest code is about -0.99296875)
the error is about ``1 - 0.99296875 = 0.00703125``, half the top step up to the fp32 rounding
of the codes (``3e-8``, inside the ``2**-22`` slack), so the same bound holds with ``h`` the
half-step of the nearest end.

**Edge inputs.** Values that are a map value times a power-of-two absmax (for example the
block's own absmax when it is positive) round-trip exactly. Subnormal inputs are honoured: the
oracle assumes no flush-to-zero, and a kernel built with flush-to-zero would differ. -0.0 takes
the zero code and decodes as +0.0. With the unsigned map, negative inputs take code 0 (value 0).
A NaN anywhere in a block makes its absmax NaN, so the whole block decodes to NaN; the NaN
elements themselves take code 0. A block holding an inf (and no NaN) has absmax inf: its finite
elements take the zero code and decode to NaN (0 * inf), its infs take code 0 and decode to
-inf (signed map) or NaN (unsigned map). Other blocks are unaffected. Nothing is repaired on
purpose: the optimizer skips a step with non-finite gradients (loss scaler) before it
quantizes, so these cases only document what the oracle does.
"""

from __future__ import annotations

import struct
from functools import cache

import torch

BLOCK = 256
"""Elements per quantization block: each block of one parameter has its own fp32 absmax."""

SIGNED_MAP_ID = "dynamic-signed-v2"
"""Id of the signed dynamic map (``exp_avg``) with format version 2's encoding
(``zerokern.quant.blockwise``: a signed scale per block); checkpoints store it next to the
codes."""

UNSIGNED_MAP_ID = "dynamic-unsigned-v2"
"""Id of the unsigned dynamic map (``exp_avg_sq``), format version 2, as ``SIGNED_MAP_ID``."""

LEGACY_MAP_IDS = {"dynamic-signed-v1": SIGNED_MAP_ID, "dynamic-unsigned-v1": UNSIGNED_MAP_ID}
"""Version 1 ids (absmax scales, the encoding of :func:`quantize_blockwise`) and the version 2
id of the same map. The 256 values are the same, so version 1 codes decode to the same values
and a version 1 state is a valid version 2 state as stored: it loads unchanged, and the next
step re-encodes it with version 2's rule."""

SIGNED_MAP_ID_V3 = "computed-signed-v3"
"""Id of format version 3's signed map (``exp_avg``; ``zerokern.quant.fmt_v3``): other values
than version 2's, so codes under it are re-encoded, never copied, into a version 2 state."""

UNSIGNED_MAP_ID_V3 = "computed-unsigned-v3"
"""Id of format version 3's unsigned map (``exp_avg_sq``), as ``SIGNED_MAP_ID_V3``."""

_MAP_SIGNED = {SIGNED_MAP_ID: True, UNSIGNED_MAP_ID: False, "dynamic-signed-v1": True,
               "dynamic-unsigned-v1": False, SIGNED_MAP_ID_V3: True, UNSIGNED_MAP_ID_V3: False}
# The int8 format version each id was written by: 1 and 2 share the dynamic maps' values, 3 has
# its own (computed) values.
_MAP_VERSION = {SIGNED_MAP_ID: 2, UNSIGNED_MAP_ID: 2, "dynamic-signed-v1": 1,
                "dynamic-unsigned-v1": 1, SIGNED_MAP_ID_V3: 3, UNSIGNED_MAP_ID_V3: 3}
# The id new states of each (sign, version) are written with: version 1's ids are read only.
_MAP_OF_VERSION = {(_MAP_SIGNED[i], v): i for i, v in _MAP_VERSION.items() if v >= 2}
MAP_IDS = tuple(_MAP_SIGNED)
"""Every map id this version can read, the ids a checkpoint may name."""


def decodes_alike(a: str | None, b: str | None) -> bool:
    """Whether codes stored under map id ``a`` mean the same values under map id ``b`` (the
    same map: versions 1 and 2 share theirs, version 3 has its own), so they can be copied
    instead of re-encoded."""
    # Versions 1 and 2 decode on the same 256 values (both step as 2); version 3 on others.
    return (a in _MAP_SIGNED and b in _MAP_SIGNED and _MAP_SIGNED[a] == _MAP_SIGNED[b]
            and step_version(a) == step_version(b))  # type: ignore[arg-type]


def map_version(map_id: str) -> int:
    """The int8 format version that wrote codes under ``map_id`` (1, 2 or 3).

    Raises:
        ValueError: an unknown id.
    """
    if map_id not in _MAP_VERSION:
        raise ValueError(f"unknown quantization map id {map_id!r}; known: {', '.join(MAP_IDS)}")
    return _MAP_VERSION[map_id]


def step_version(map_id: str) -> int:
    """The ``format_version`` the fused step runs codes under ``map_id`` with: 3 for version
    3's maps, else 2 (a version 1 state decodes like version 2 and is re-encoded by it)."""
    return 3 if map_version(map_id) == 3 else 2


def versioned_map_id(map_id: str, version: int) -> str:
    """The id of the map of format ``version`` (2 or 3) with ``map_id``'s sign (signed for
    ``exp_avg``, unsigned for ``exp_avg_sq``).

    Raises:
        ValueError: an unknown id or version.
    """
    map_version(map_id)
    key = (_MAP_SIGNED[map_id], version)
    if isinstance(version, bool) or key not in _MAP_OF_VERSION:
        raise ValueError(f"int8 format version must be 2 or 3, got {version!r}")
    return _MAP_OF_VERSION[key]


_CODES = 256
_EXPONENTS = 7  # e = 0..6 leading zero bits; e = 7 (all zeros) is the code for 0


def _f32(x: float) -> float:
    # Round a Python float (a double) to the nearest fp32, ties to even. A +, -, * or / of two
    # fp32 values computed in double and rounded here equals the fp32 operation (double keeps
    # enough bits that the second rounding never differs), so this gives exact fp32 arithmetic.
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _bin_centres(bins: int) -> list[float]:
    """The centres of ``bins`` equal bins splitting [0.1, 1], in the anchors' fp32 order."""
    edges = bins + 1
    start = _f32(0.1)
    step = _f32(_f32(1.0 - start) / bins)
    half = edges // 2
    # step * i and the sum are exact in double (24 + 8 bits), so one _f32 is a fused
    # multiply-add: torch.linspace evaluates its edges that way on CPU.
    edge = [
        _f32(start + step * i) if i < half else _f32(1.0 - step * (bins - i))
        for i in range(edges)
    ]
    return [_f32(_f32(edge[i] + edge[i + 1]) / 2.0) for i in range(bins)]


@cache
def _map_values(signed: bool) -> tuple[float, ...]:
    values = [0.0, 1.0]
    for e in range(_EXPONENTS):
        # e leading zeros, an indicator bit, then 6 - e fraction bits (7 - e when unsigned).
        bins = 2 ** (_EXPONENTS - 1 - e + (0 if signed else 1))
        scale = _f32(10.0**-e)
        for centre in _bin_centres(bins):
            v = _f32(scale * centre)
            values.append(v)
            if signed:
                values.append(-v)
    values.sort()
    assert len(values) == _CODES and len(set(values)) == _CODES
    return tuple(values)


def create_dynamic_map(signed: bool) -> torch.Tensor:
    """Build the dynamic-exponent 8-bit map (see the module docstring for its definition).

    Args:
        signed: the signed map (``exp_avg``, values in [-0.99296875, 1] to fp32 precision) or
            the unsigned one (``exp_avg_sq``, values in [0, 1]).

    Returns:
        A new fp32 CPU tensor of 256 strictly increasing values; code ``k`` means ``map[k]``.
    """
    return torch.tensor(_map_values(bool(signed)), dtype=torch.float32)


def code_map(map_id: str, device: torch.device | str | None = None) -> torch.Tensor:
    """The map a checkpoint names by its id.

    Args:
        map_id: one of :data:`MAP_IDS` (version 3's ids give ``fmt_v3.code_map_v3``).
        device: where to put the tensor (default CPU).

    Returns:
        A new fp32 tensor of 256 sorted values.

    Raises:
        ValueError: the id is unknown (written by a newer version, or corrupt).
    """
    if map_version(map_id) == 3:
        from .fmt_v3 import code_map_v3  # imports this module: looked up on use

        return code_map_v3(_MAP_SIGNED[map_id], device).clone()
    return create_dynamic_map(_MAP_SIGNED[map_id]).to(device)


def _check_code(code: torch.Tensor) -> None:
    if code.dtype != torch.float32 or code.shape != (_CODES,):
        raise ValueError(
            f"code must be an fp32 tensor of {_CODES} values, got {code.dtype} {tuple(code.shape)}"
        )
    if not bool((code[1:] > code[:-1]).all()):
        raise ValueError("code must be strictly increasing")


def decision_thresholds(code: torch.Tensor) -> torch.Tensor:
    """The 255 fp32 boundaries between neighbouring codes that :func:`quantize_blockwise` uses.

    ``t_k`` is the exact midpoint ``(code[k] + code[k+1]) / 2`` rounded once to fp32 (nearest,
    ties to even). The sum of two fp32 values is exact in float64, so computing it there and
    casting gives that single rounding. Kernels load this table instead of recomputing it.

    Args:
        code: a map, 256 strictly increasing fp32 values.

    Returns:
        An fp32 tensor of 255 non-decreasing values on ``code``'s device.
    """
    _check_code(code)
    wide = code.detach().to("cpu", torch.float64)
    return ((wide[:-1] + wide[1:]) / 2).to(torch.float32).to(code.device)


@cache
def _tables_cpu() -> torch.Tensor:
    inf = torch.tensor([float("inf")])
    parts = []
    for map_id in (SIGNED_MAP_ID, UNSIGNED_MAP_ID):
        code = code_map(map_id)
        parts += [code, decision_thresholds(code), inf]
    return torch.cat(parts)


_TABLES: dict[torch.device, torch.Tensor] = {}


def kernel_tables(device: torch.device | str) -> torch.Tensor:
    """The maps as the fused kernels read them: one fp32 tensor of 1024 values on ``device``,
    ``[signed map (256) | its 255 thresholds, +inf | unsigned map (256) | its 255
    thresholds, +inf]``. The +inf pads each threshold table to 256 entries, so a kernel can
    count ``t_k < n`` over 256 entries (``+inf < n`` is never true) with a branch-free
    binary search. Cached per device; do not modify the result."""
    dev = torch.device(device)
    t = _TABLES.get(dev)
    if t is None:
        t = _TABLES[dev] = _tables_cpu().to(dev)
    return t


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")


def quantize_blockwise(
    x: torch.Tensor, code: torch.Tensor, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize one parameter's fp32 elements to 8-bit codes with one absmax per block.

    Blocks are ``block`` consecutive elements of ``x`` flattened in row-major order; the last
    one is partial when ``x.numel()`` is not a multiple of ``block``. The rounding rules, the
    error bound and what NaN/inf/subnormal inputs do are in the module docstring.

    Args:
        x: fp32 tensor of any shape.
        code: the map, 256 strictly increasing fp32 values on ``x``'s device.
        block: elements per block.

    Returns:
        ``(codes, absmax)``: uint8 codes shaped like ``x``, and fp32 absmax of
        ``ceil(x.numel() / block)`` elements.

    Raises:
        TypeError: ``x`` is not fp32.
        ValueError: a malformed ``code`` or ``block``.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"quantize_blockwise takes fp32, got {x.dtype}")
    _check_block(block)
    thresholds = decision_thresholds(code).to(x.device)
    flat = x.detach().reshape(-1)
    numel = flat.numel()
    nblocks = -(-numel // block)
    # Zero padding cannot change a block's absmax (|x| >= 0, and a NaN still wins the max).
    blocks = torch.nn.functional.pad(flat, (0, nblocks * block - numel)).view(nblocks, block)
    absmax = blocks.abs().amax(dim=1) if numel else flat.new_empty(0)
    divisor = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    # Through float64: correctly rounded whatever fp32 division kernel torch would pick.
    normed = (blocks.double() / divisor.double()[:, None]).float().contiguous()
    below = torch.searchsorted(thresholds, normed, right=False)  # #{t_k < n}
    at_or_below = torch.searchsorted(thresholds, normed, right=True)  # #{t_k <= n}
    index = torch.where(normed < 0, at_or_below, below)  # ties toward zero
    index = torch.where(torch.isnan(normed), torch.zeros_like(index), index)
    codes = index.to(torch.uint8).reshape(-1)[:numel].reshape(x.shape)
    return codes, absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block: int = BLOCK
) -> torch.Tensor:
    """Decode :func:`quantize_blockwise`'s output: ``code[codes] * absmax`` of each block in fp32.

    Args:
        codes: uint8 tensor of any shape (blocks run over it flattened).
        absmax: fp32, one value per block, ``ceil(codes.numel() / block)`` of them.
        code: the map the codes were made with.
        block: elements per block, as when quantizing.

    Returns:
        An fp32 tensor shaped like ``codes``.

    Raises:
        TypeError: ``codes`` is not uint8 or ``absmax`` is not fp32.
        ValueError: a malformed ``code`` or ``block``, or the wrong number of absmax values.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if absmax.dtype != torch.float32:
        raise TypeError(f"absmax must be fp32, got {absmax.dtype}")
    _check_code(code)
    _check_block(block)
    flat = codes.reshape(-1)
    numel = flat.numel()
    nblocks = -(-numel // block)
    if absmax.numel() != nblocks:
        raise ValueError(f"{numel} codes in blocks of {block} need {nblocks} absmax values, "
                         f"got {absmax.numel()}")
    scale = absmax.reshape(-1).repeat_interleave(block)[:numel]
    return (code[flat.long()] * scale).reshape(codes.shape)
