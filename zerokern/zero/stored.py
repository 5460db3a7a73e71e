"""One stored buffer of optimizer state (issue 36): what a moment (or any buffer an update rule
keeps per element) is stored as, read back as fp32, written from fp32, and written to a
checkpoint as.

- ``Fp32Stored``: fp32 values; reading copies, writing copies.
- ``Bf16Stored``: bf16 values; reading widens (exact), writing rounds to nearest even
  ([Note: 16-bit values are rounded to nearest even] in zerokern/ops/adamw.py).
- ``Int8Stored``: uint8 codes on a code map (``map_id``) with one fp32 signed scale per
  256-element block (``zerokern.quant.maps``). The map id names the int8 format version too:
  version 2's dynamic maps (1's decode alike) or version 3's computed maps
  (``zerokern.quant.fmt_v3``). Reading dequantizes on the map; writing quantizes with the
  version's quantizer (``requantize_blockwise`` for version 2: a decoded block gets its own
  codes back; ``quantize_blockwise_v3`` for version 3, which re-encodes decoded normal values
  exactly), the one path by which fp32 values from outside the step are stored into int8.

The format name ("fp32", "bf16", "int8") is looked up once, in ``stored_type``; everything
else asks the type. A ``Stored`` is a view: ``narrow`` gives a range of it (an int8 range
starts on a block), and reads and writes go to the buffers it was made over.
"""

from __future__ import annotations

from abc import ABC
from typing import ClassVar

import torch

from ..quant.fmt_v3 import quantize_blockwise_v3
from ..quant.maps import (
    BLOCK,
    SIGNED_MAP_ID_V3,
    code_map,
    dequantize_blockwise,
    step_version,
)
from ..quant.requantize import requantize_blockwise


def blocks(n: int) -> int:
    """256-element blocks (the last one partial) of ``n`` elements."""
    return -(-n // BLOCK)


class Stored(ABC):
    """``numel`` elements of one state buffer, as stored. ``data``: the values, or the codes;
    ``absmax``: the blocks' scales (int8) or None; ``map_id``: the code map (int8) or None."""

    fmt: ClassVar[str]
    dtype: ClassVar[torch.dtype]  # of ``data``
    blockwise: ClassVar[bool] = False  # scaled per 256-element block (ranges start on one)

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.absmax: torch.Tensor | None = None
        self.map_id: str | None = None

    @property
    def numel(self) -> int:
        return self.data.numel()

    # -- what it allocates and how a checkpoint names it (pure) --------------------------------
    @classmethod
    def parts(cls, numel: int) -> list[tuple[str, int, torch.dtype]]:
        """(part, elements, dtype) of a buffer of ``numel`` elements: ``"data"`` first."""
        return [("data", numel, cls.dtype)]

    @classmethod
    def file_tensors(cls, key: str) -> dict[str, tuple[str, torch.dtype]]:
        """part -> (the rank-file tensor holding it, dtype), for buffer ``key`` kept in a
        checkpoint's per-format tensors (checkpoint/moments.py)."""
        return {"data": (f"{key}.{cls.fmt}", cls.dtype)}

    @staticmethod
    def scale_count(numel: int) -> int:
        """Scales (absmax values) of ``numel`` elements: 0 but for int8."""
        return 0

    @classmethod
    def make(cls, parts: dict[str, torch.Tensor], map_id: str | None = None) -> Stored:
        """The stored buffer over its ``parts`` tensors (as ``parts()`` names them)."""
        return cls(parts["data"])

    # -- reading and writing ------------------------------------------------------------------
    def part(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        assert t is not None, name
        return t

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its parts, by name."""
        return {name: self.part(name) for name, _, _ in self.parts(self.numel)}

    def read(self) -> torch.Tensor:
        """A new fp32 tensor of its values."""
        return self.data.to(torch.float32, copy=True)

    def write(self, x: torch.Tensor) -> None:
        """Store the fp32 values ``x`` (``numel`` elements) as this buffer stores them."""
        self.data.copy_(x.reshape(-1))

    def assign_from(self, x: torch.Tensor) -> None:
        """Store ``x`` given in this buffer's dtype or as fp32 values: what a cast stores
        (fp32, bf16) or, for int8, ``write``."""
        self.data.copy_(x.reshape(-1))

    def narrow(self, start: int, numel: int) -> Stored:
        """Elements [start, start + numel) of it, a view."""
        return type(self)(self.data.narrow(0, start, numel))

    def zero_(self) -> None:
        """As a fresh state stores it: every format's zero bytes decode to exact zeros."""
        for t in self.tensors().values():
            t.zero_()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(numel={self.numel})"


class Fp32Stored(Stored):
    fmt, dtype = "fp32", torch.float32


class Bf16Stored(Stored):
    fmt, dtype = "bf16", torch.bfloat16


class Int8Stored(Stored):
    fmt, dtype, blockwise = "int8", torch.uint8, True

    def __init__(self, codes: torch.Tensor, absmax: torch.Tensor, map_id: str) -> None:
        super().__init__(codes)
        self.absmax, self.map_id = absmax, map_id

    @classmethod
    def parts(cls, numel: int) -> list[tuple[str, int, torch.dtype]]:
        return [("data", numel, cls.dtype), ("absmax", blocks(numel), torch.float32)]

    @classmethod
    def file_tensors(cls, key: str) -> dict[str, tuple[str, torch.dtype]]:
        return {"data": (f"{key}.{cls.fmt}", cls.dtype), "absmax": (f"{key}.absmax",
                                                                      torch.float32)}

    @staticmethod
    def scale_count(numel: int) -> int:
        return blocks(numel)

    @classmethod
    def make(cls, parts: dict[str, torch.Tensor], map_id: str | None = None) -> Stored:
        assert map_id is not None, "int8 codes need their code map"
        return cls(parts["data"], parts["absmax"], map_id)

    @staticmethod
    def decode(codes: torch.Tensor, absmax: torch.Tensor, map_id: str) -> torch.Tensor:
        """fp32 values of ``codes`` (whole blocks) scaled by ``absmax`` on map ``map_id``."""
        return dequantize_blockwise(codes, absmax, code_map(map_id, codes.device))

    def read(self) -> torch.Tensor:
        assert self.absmax is not None and self.map_id is not None
        return self.decode(self.data, self.absmax, self.map_id)

    def write(self, x: torch.Tensor) -> None:
        assert self.absmax is not None and self.map_id is not None
        flat = x.to(self.data.device, torch.float32).reshape(-1)
        if self.version == 3:
            codes, absmax = quantize_blockwise_v3(flat, self.map_id == SIGNED_MAP_ID_V3)
        else:  # a version 1 state is written as version 2 (the same map's values)
            codes, absmax = requantize_blockwise(flat, code_map(self.map_id, self.data.device))
        self.data.copy_(codes)
        self.absmax.copy_(absmax)

    @property
    def version(self) -> int:
        """The format version the fused step runs these codes with (2 or 3)."""
        assert self.map_id is not None
        return step_version(self.map_id)

    def assign_from(self, x: torch.Tensor) -> None:
        self.write(x.float())

    def narrow(self, start: int, numel: int) -> Stored:
        assert start % BLOCK == 0, "an int8 range starts on a block"
        assert self.absmax is not None and self.map_id is not None
        return Int8Stored(self.data.narrow(0, start, numel),
                          self.absmax.narrow(0, start // BLOCK, blocks(numel)), self.map_id)

    def __repr__(self) -> str:
        return f"Int8Stored(numel={self.numel}, map_id={self.map_id!r})"


STORED_TYPES: dict[str, type[Stored]] = {t.fmt: t for t in (Fp32Stored, Bf16Stored,
                                                              Int8Stored)}

STORED_PARTS: tuple[str, ...] = tuple(dict.fromkeys(
    p for t in STORED_TYPES.values() for p, _, _ in t.parts(1)))
"""Every part a stored buffer can have ("data", "absmax"), in the order they are allocated."""


def stored_type(fmt: str) -> type[Stored]:
    """The type storing format ``fmt`` ("fp32", "bf16" or "int8"): where a name becomes a
    type."""
    try:
        return STORED_TYPES[fmt]
    except KeyError:
        raise ValueError(f"unknown stored format {fmt!r} (known: "
                         f"{', '.join(STORED_TYPES)})") from None
