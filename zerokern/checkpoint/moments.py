"""Compressed optimizer state in a checkpoint (issue 27): its layout on disk, its checks, and
reading it back, exactly or as fp32.

A checkpoint of a ZeroAdamW whose state is not the default (fp32 moments and fp32 master)
names the format in a top-level ``"state_format"`` entry of meta.json::

    {"moments": "int8", "master": "none", "seed": 7, "block": 256,
     "maps": {"exp_avg": "dynamic-signed-v2", "exp_avg_sq": "dynamic-unsigned-v2"}}

(``block`` and ``maps`` with int8 moments only). The map ids name the int8 format version
too: ``dynamic-*-v1`` / ``-v2`` (versions 1 and 2, the same maps) or ``computed-*-v3``
(version 3); an id this zerokern does not know is refused, naming the field. The values
tensor ``master`` of each rank file holds the fp32 master, or with ``master="none"`` the bf16
parameters themselves: there is no master, the parameters are the values, and ``seed`` keys
their stochastic rounding.

With ``moments="fp32"`` the moments stay where a default checkpoint has them (``exp_avg`` and
``exp_avg_sq`` beside ``master``, fp32, at the piece's offset). Otherwise each rank file's entry
in meta.json has a ``"moments"`` table of rows ``[param name, param offset, numel, format,
offset, block]``, one per piece, and the moments are stored as the optimizer stores them:

- format "fp32" (parameters under 4,096 elements): tensors ``exp_avg.fp32`` / ``exp_avg_sq.fp32``;
- "bf16": ``exp_avg.bf16`` / ``exp_avg_sq.bf16``;
- "int8": the uint8 codes in ``exp_avg.int8`` / ``exp_avg_sq.int8`` (``offset`` counts codes)
  and one fp32 absmax per 256-element block in ``exp_avg.absmax`` / ``exp_avg_sq.absmax``
  (``block`` is the index of the piece's first block there; 0 in rows of other formats).

Why int8 moves as codes: quantizing dequantized values does not always give the codes back
(the signed map has no -1.0), so only codes and absmax restore a state bit for bit. And why
that reshards: the blocks are the parameter's own (elements [256 k, 256 k + 256) of the
flattened parameter), every int8 piece starts on one and ends on one or at the parameter's end,
at every world size and stage, so the codes and absmax of any new piece are a concatenation of
saved ones. Loading into another format goes through fp32: dequantize, then store as the
target stores (quantize per block, round to nearest even into bf16, or copy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..quant.adamw import (
    DEFAULT_INT8_FORMAT,
    INT8_FORMATS,
    MASTER_MODES,
    MOMENT_FORMATS,
    effective_moments_format,
)
from ..quant.maps import BLOCK, MAP_IDS, decodes_alike
from ..zero.rules import ADAMW
from ..zero.state_format import StateFormat
from ..zero.stored import STORED_TYPES, Int8Stored, stored_type
from .format import CHUNK_BYTES, CheckpointError, is_count

STATE_FORMAT = "state_format"  # meta.json's top-level entry
MOMENTS_TABLE = "moments"  # a file entry's table of moment rows
MOMENTS = ADAMW.state_names  # the buffers a checkpoint holds (AdamW's two moments)
MOMENT_DTYPES = {fmt: t.dtype for fmt, t in STORED_TYPES.items()}
MOMENT_ROW = "[param name, param offset, numel, format, offset, block]"
FORMAT_KEYS = frozenset({"moments", "master", "seed", "block", "maps"})

# Reads elements [lo, hi) of tensor ``name`` of rank file ``file`` (a CPU tensor in the stored
# dtype): safetensors slices in load.py, pread in the consolidate command.
RawReader = Callable[[str, str, int, int], torch.Tensor]


def tensor_name(key: str, fmt: str) -> str:
    """The rank-file tensor of moment ``key`` stored in format ``fmt`` (a table's format)."""
    return stored_type(fmt).file_tensors(key)["data"][0]


def absmax_name(key: str) -> str:
    """The rank-file tensor of moment ``key``'s block scales (int8)."""
    return Int8Stored.file_tensors(key)["absmax"][0]


def blockwise(fmt: str) -> bool:
    """Whether format ``fmt`` stores blocks with their own scales (int8)."""
    return stored_type(fmt).blockwise


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def format_entry(moments: str, master: str, seed: int,
                 int8_format: int = DEFAULT_INT8_FORMAT) -> dict[str, Any] | None:
    """meta.json's ``state_format`` of a state stored so (None: the default, fp32 and fp32,
    written as before); ``int8_format`` picks the maps named for int8 moments."""
    if moments == "fp32" and master == "fp32":
        return None
    out: dict[str, Any] = {"moments": moments, "master": master, "seed": int(seed)}
    if blockwise(moments):
        out["block"] = BLOCK
        out["maps"] = {key: ADAMW.map_id(key, int8_format) for key in MOMENTS}
    return out


def has_table(meta: dict[str, Any]) -> bool:
    """Whether the moments are in per-format tensors (a ``moments`` table per file) rather
    than in the state triple."""
    sf = meta.get(STATE_FORMAT)
    return sf is not None and sf["moments"] != "fp32"


def values_dtype(meta: dict[str, Any]) -> torch.dtype:
    """The dtype of the ``master`` tensor: fp32, or bf16 (the parameters) for master="none"."""
    sf = meta.get(STATE_FORMAT)
    return StateFormat.of(sf).master_dtype


def check_state_format(sf: Any, param_dtype: Any, error: Callable[[str, str], Exception]) -> None:
    """meta.json's ``state_format`` entry: known names, a seed, the block and the code maps
    this zerokern reads. ``error(field, why)`` makes the exception."""
    if not isinstance(sf, dict):
        raise error(STATE_FORMAT, f"must be a JSON object, got {sf!r:.80}")
    int8 = sf.get("moments") in MOMENT_FORMATS and blockwise(sf["moments"])
    required = {"moments", "master", "seed"} | ({"block", "maps"} if int8 else set())
    for k in sorted(required - sf.keys()):
        raise error(STATE_FORMAT, f"lacks the entry {k!r}")
    for k in sorted(sf.keys() - (required if not int8 else FORMAT_KEYS)):
        raise error(STATE_FORMAT, f"has an unknown entry {k!r}")
    if sf["moments"] not in MOMENT_FORMATS:
        raise error(f"{STATE_FORMAT}.moments", f"must be one of {', '.join(MOMENT_FORMATS)}, "
                                                f"got {sf['moments']!r:.80}")
    if sf["master"] not in MASTER_MODES:
        raise error(f"{STATE_FORMAT}.master", f"must be one of {', '.join(MASTER_MODES)}, "
                                               f"got {sf['master']!r:.80}")
    if sf["moments"] == "fp32" and sf["master"] == "fp32":
        raise error(STATE_FORMAT, "names the default state (fp32 moments and master), which "
                                  "a checkpoint stores without the entry")
    seed = sf["seed"]
    if not is_count(seed) or seed >= 2**63:
        raise error(f"{STATE_FORMAT}.seed", f"must be an integer in [0, 2**63), got {seed!r:.80}")
    if StateFormat.of(sf).in_place and param_dtype != "bfloat16":
        raise error(f"{STATE_FORMAT}.master", f"is 'none' (bf16 parameters only), but "
                                               f"param_dtype is {param_dtype!r:.80}")
    if int8:
        if sf["block"] != BLOCK or not is_count(sf["block"]):
            raise error(f"{STATE_FORMAT}.block", f"must be {BLOCK}, got {sf['block']!r:.80}")
        maps = sf["maps"]
        if not isinstance(maps, dict) or set(maps) != set(MOMENTS):
            raise error(f"{STATE_FORMAT}.maps", f"must name the maps of {' and '.join(MOMENTS)}"
                                                f", got {maps!r:.80}")
        for k, v in maps.items():
            if v not in MAP_IDS:
                raise error(f"{STATE_FORMAT}.maps.{k}",
                            f"is {v!r:.80}, a code map this zerokern does not know (known: "
                            f"{', '.join(MAP_IDS)}; an int8 format version written by a "
                            f"newer zerokern?)")
            if not any(decodes_alike(v, ADAMW.map_id(k, ver)) for ver in INT8_FORMATS):
                raise error(f"{STATE_FORMAT}.maps.{k}", f"is {v!r}, not a map of {k}")


@dataclass(frozen=True)
class MomentSpan:
    """One row of a ``moments`` table: elements [param_offset, param_offset + numel) of a
    parameter, stored in ``fmt`` at ``offset`` (codes for int8) and ``block`` (absmax)."""

    param_offset: int
    numel: int
    file: str
    fmt: str
    offset: int
    block: int
    row: str  # "files[i].moments[j]", for messages

    @property
    def stop(self) -> int:
        return self.param_offset + self.numel


def moment_row(row: Any, at: str) -> tuple[str, int, int, str, int, int]:
    """One row of a moments table, checked for form."""
    if not (isinstance(row, list) and len(row) == 6):
        raise CheckpointError(f"{at} must be a row {MOMENT_ROW}, got {row!r:.80}")
    name, po, n, fmt, off, blk = row
    if not isinstance(name, str):
        raise CheckpointError(f"{at}: the param name must be a string, got {name!r:.80}")
    if fmt not in MOMENT_FORMATS:
        raise CheckpointError(f"{at}: the format must be one of {', '.join(MOMENT_FORMATS)}, "
                              f"got {fmt!r:.80}")
    for what, v in (("param offset", po), ("numel", n), ("offset", off), ("block", blk)):
        if not is_count(v):
            raise CheckpointError(f"{at}: the {what} must be an integer >= 0, got {v!r:.80}")
    return name, po, n, fmt, off, blk


class MomentIndex:
    """Every row of the moments tables by parameter name, sorted by offset in the parameter;
    check() proves they tile the trained parameters in the format the state stores them in,
    int8 rows on the parameter's own blocks."""

    def __init__(self, meta: dict[str, Any], where: str) -> None:
        self.where = where
        self.maps: dict[str, str] = dict(meta[STATE_FORMAT].get("maps") or {})
        self.by_name: dict[str, list[MomentSpan]] = {}
        for i, f in enumerate(meta["files"]):
            for j, row in enumerate(f[MOMENTS_TABLE]):
                at = f"files[{i}].{MOMENTS_TABLE}[{j}]"
                name, po, n, fmt, off, blk = moment_row(row, f"{where}: {at}")
                if n:
                    self.by_name.setdefault(name, []).append(
                        MomentSpan(po, n, f["name"], fmt, off, blk, at))
        for spans in self.by_name.values():
            spans.sort(key=lambda s: s.param_offset)

    def check(self, params: dict[str, dict[str, Any]], moments: str) -> None:
        w = self.where
        for name, spans in self.by_name.items():
            p = params.get(name)
            if p is None or not p["managed"]:
                raise CheckpointError(f"{w}: {spans[0].row} holds moments of {name!r}, which "
                                      "is not a trained parameter")
        for name, p in params.items():
            if not p["managed"]:
                continue
            numel = math.prod(p["shape"])
            want = effective_moments_format(moments, numel)
            pos = 0
            for s in self.by_name.get(name, []):
                if s.fmt != want:
                    raise CheckpointError(f"{w}: {s.row} stores moments of {name!r} ({numel} "
                                          f"elements) as {s.fmt!r}; moments={moments!r} stores "
                                          f"them as {want!r}")
                if s.param_offset != pos or s.stop > numel:
                    raise CheckpointError(f"{w}: the moment rows of {name!r} leave a gap, "
                                          f"overlap or overrun at element {pos} ({s.row})")
                if blockwise(s.fmt) and (s.param_offset % BLOCK or
                                        (s.stop % BLOCK and s.stop != numel)):
                    raise CheckpointError(f"{w}: {s.row} holds int8 elements [{s.param_offset}"
                                          f", {s.stop}) of {name!r}, not whole {BLOCK}-element"
                                          " blocks of the parameter")
                pos = s.stop
            if pos != numel:
                raise CheckpointError(f"{w}: the moment rows of {name!r} cover {pos} of its "
                                      f"{numel} elements")

    def format_of(self, name: str) -> str | None:
        spans = self.by_name.get(name)
        return spans[0].fmt if spans else None

    def spans(self, name: str, lo: int, hi: int) -> Iterator[tuple[MomentSpan, int, int]]:
        """(row, a, b): the rows holding elements [lo, hi) of ``name``, each with the part
        [a, b) of it in the parameter's element space."""
        for s in self.by_name.get(name, []):
            a, b = max(lo, s.param_offset), min(hi, s.stop)
            if a < b:
                yield s, a, b


def check_table_tiling(rows: list[Any], tensors: dict[str, Any],
                       bad: Callable[[str], Exception], i: int) -> None:
    """A rank file's moment rows (checked for form) tile its moment tensors: per format,
    the codes or values by (offset, numel), int8 absmax by (block, blocks(numel)); so every
    read of a load is in bounds."""
    for fmt in sorted({r[3] for r in rows}):
        spans = [("offsets", tensor_name(MOMENTS[0], fmt), [(r[4], r[2], j) for j, r in
                                                            enumerate(rows) if r[3] == fmt])]
        if blockwise(fmt):
            spans.append(("blocks", absmax_name(MOMENTS[0]),
                          [(r[5], blocks(r[2]), j) for j, r in enumerate(rows) if r[3] == fmt]))
        for what, tensor, items in spans:
            stored, pos = tensors[tensor].numel, 0
            for off, n, j in sorted(items):
                if off != pos or off + n > stored:
                    raise bad(f"the {fmt} moment rows' {what} leave a gap, overlap or overrun "
                              f"tensor {tensor!r} ({stored} elements) at {pos} "
                              f"(files[{i}].{MOMENTS_TABLE}[{j}])")
                pos += n
            if pos != stored:
                raise bad(f"the {fmt} moment rows cover {pos} of the {stored} elements of "
                          f"tensor {tensor!r}")


def expected_tensors(rows: list[Any]) -> dict[str, torch.dtype]:
    """The moment tensors a rank file with these moment rows holds, and their dtypes."""
    out: dict[str, torch.dtype] = {}
    for fmt in {r[3] for r in rows}:
        for key in MOMENTS:
            out.update(stored_type(fmt).file_tensors(key).values())
    return out


# -- reading --------------------------------------------------------------------------------------
_CHUNK = max(BLOCK, CHUNK_BYTES // 4 // BLOCK * BLOCK)  # elements per read: whole blocks


def read_fp32_into(index: MomentIndex, raw: RawReader, name: str, lo: int, dst: torch.Tensor,
                   key: str) -> None:
    """``dst`` (1-D) <- elements [lo, lo + dst.numel()) of moment ``key`` of ``name``, as fp32
    values (int8 blocks dequantized whole, then cut) cast to ``dst``'s dtype (bf16: rounded to
    nearest even: what storing the fp32 values as bf16 does)."""
    hi = lo + dst.numel()
    for s, a, b in index.spans(name, lo, hi):
        if not blockwise(s.fmt):
            t = tensor_name(key, s.fmt)
            for ca in range(a, b, _CHUNK):
                cb = min(b, ca + _CHUNK)
                d = s.offset - s.param_offset
                dst.narrow(0, ca - lo, cb - ca).copy_(raw(s.file, t, ca + d, cb + d))
            continue
        # The whole blocks that hold [a, b).
        first = s.param_offset + (a - s.param_offset) // BLOCK * BLOCK
        last = min(s.stop, s.param_offset + blocks(b - s.param_offset) * BLOCK)
        for ca in range(first, last, _CHUNK):
            cb = min(last, ca + _CHUNK)
            rel = ca - s.param_offset
            codes = raw(s.file, tensor_name(key, s.fmt), s.offset + rel, s.offset + cb -
                        s.param_offset)
            b0 = s.block + rel // BLOCK
            absmax = raw(s.file, absmax_name(key), b0, b0 + blocks(cb - ca))
            vals = Int8Stored.decode(codes, absmax, index.maps[key])
            x, y = max(a, ca), min(b, cb)
            if x < y:
                dst.narrow(0, x - lo, y - x).copy_(vals.narrow(0, x - ca, y - x))


def copy_int8_into(index: MomentIndex, raw: RawReader, name: str, lo: int, codes: torch.Tensor,
                   absmax: torch.Tensor, key: str) -> None:
    """The stored codes and absmax of elements [lo, lo + codes.numel()) of moment ``key``,
    exactly (an int8 range starts on a block of its parameter and ends on one or at the
    parameter's end; so do the saved rows)."""
    hi = lo + codes.numel()
    assert lo % BLOCK == 0, "an int8 range starts on a block of its parameter"
    for s, a, b in index.spans(name, lo, hi):
        assert blockwise(s.fmt) and (a - s.param_offset) % BLOCK == 0
        for ca in range(a, b, _CHUNK):
            cb = min(b, ca + _CHUNK)
            rel = ca - s.param_offset
            codes.narrow(0, ca - lo, cb - ca).copy_(
                raw(s.file, tensor_name(key, s.fmt), s.offset + rel, s.offset + rel + cb - ca))
            b0, nb = s.block + rel // BLOCK, blocks(cb - ca)
            absmax.narrow(0, (ca - lo) // BLOCK, nb).copy_(raw(s.file, absmax_name(key), b0,
                                                              b0 + nb))
