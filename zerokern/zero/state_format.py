"""How the optimizer state is stored (issue 27), and where each stored format runs in this rank's
local space. Pure: no tensors, so the plan is testable alone and the same on every rank.

``StateFormat(moments, master)``: ``moments`` "fp32" | "bf16" | "int8" and ``master`` "fp32" |
"none". The default (fp32, fp32) is today's exact AdamW and changes nothing: the engines keep
their plain fp32 buffers and one fused launch per range.

Otherwise the state is split into **runs**: contiguous local ranges of one parameter group and
one effective moments format (a parameter with fewer than 4,096 elements in total keeps fp32
moments, decided on the whole parameter, so never on a shard), each stepped by one call of the
compressed kernel (``zerokern.ops.adamw_compressed``). Consecutive pieces join a run only where
every 256-element chunk of the run still lies in one parameter (the piece before ends on a
chunk boundary), so:

* int8 blocks are the parameter's own blocks: the layout starts every int8 parameter on a
  256-element boundary and cuts shards on them (``param_align``, ``layout_alignment``), so a
  piece starts on a block of its parameter and a block never straddles two ranks;
* the stochastic rounding of ``master="none"`` finds each element's index in its parameter
  from one number per chunk (``StateRun.sr_index``).

Padding between pieces is never in a run: nothing reads or writes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..quant.adamw import (
    DEFAULT_INT8_FORMAT,
    MASTER_MODES,
    MIN_COMPRESSED_NUMEL,
    MOMENT_FORMATS,
    check_int8_format,
)
from ..quant.adamw import effective_moments_format as _effective
from ..quant.maps import BLOCK
from .stored import stored_type

# [Note: blocks never straddle shards]
# An int8 block is 256 consecutive elements of one parameter, counted from the parameter's
# first element. A parameter stored in int8 starts on a QUANT_ALIGN boundary of the flat space
# and every shard boundary falls on one too, so each block lives whole on one rank: its scale
# is taken over the same 256 values, and its codes are the same bits, whatever the world size,
# stage or mesh (the tests compare them across all three). Layouts round to QUANT_ALIGN for
# this reason, and the communication codec keeps its blocks inside one rank's piece for the
# same one; both cite this note.
QUANT_ALIGN = BLOCK
"""Elements of one quantization block: int8 parameters start on, and shards end on, these."""


def quant_align(numel: int) -> int:
    """The start alignment (elements) of a parameter of ``numel`` elements under int8 moments:
    one block for a parameter large enough to be quantized, 1 (packed) otherwise."""
    return QUANT_ALIGN if numel >= MIN_COMPRESSED_NUMEL else 1


@dataclass(frozen=True)
class StateFormat:
    """``ZeroAdamW(moments=, master=, int8_format=)``: what the optimizer state is stored as.
    ``int8_format``: the int8 moments' format version (2 or 3), which picks the code maps of
    a new state (``UpdateRule.map_id``); the other moment formats ignore it."""

    moments: str = "fp32"
    master: str = "fp32"
    int8_format: int = DEFAULT_INT8_FORMAT

    def __post_init__(self) -> None:
        if not isinstance(self.moments, str) or self.moments not in MOMENT_FORMATS:
            raise ValueError(f"moments must be one of {', '.join(map(repr, MOMENT_FORMATS))}, "
                             f"got {self.moments!r}")
        if not isinstance(self.master, str) or self.master not in MASTER_MODES:
            raise ValueError(f"master must be one of {', '.join(map(repr, MASTER_MODES))}, "
                             f"got {self.master!r}")
        check_int8_format(self.int8_format)

    @classmethod
    def of(cls, entry: Any) -> StateFormat:
        """The format a saved ``state_format`` entry (a dict naming moments and master;
        None: the default state) names."""
        return cls() if entry is None else cls(entry["moments"], entry["master"])

    @staticmethod
    def saved_in_place(entry: Any) -> bool:
        """Whether a saved ``state_format`` entry (a dict, or None) names master="none"
        (whatever else it holds: a state dict from outside is checked elsewhere)."""
        return entry is not None and entry.get("master") == "none"

    @property
    def is_default(self) -> bool:
        """fp32 moments and an fp32 master: today's exact state, stored as before."""
        return self.moments == "fp32" and self.master == "fp32"

    @property
    def in_place(self) -> bool:
        """``master="none"``: no master, the parameters are the values, updated in place."""
        return self.master == "none"

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the values a state keeps beside the parameters: the fp32 master, or
        with ``master="none"`` (ZeRO-Offload's host copy of the parameters) bf16."""
        return torch.bfloat16 if self.in_place else torch.float32

    @property
    def blockwise(self) -> bool:
        """Whether the layout must keep 256-element blocks whole (int8 moments)."""
        return stored_type(self.moments).blockwise

    def effective(self, total_numel: int) -> str:
        """The moments format a parameter of ``total_numel`` elements is stored in."""
        return _effective(self.moments, total_numel)

    def param_align(self, numels: Sequence[int]) -> list[int] | None:
        """Each parameter's start alignment in the flat layout (None: packed as always)."""
        return [quant_align(n) for n in numels] if self.blockwise else None

    def layout_alignment(self, default: int) -> int:
        """Shard boundaries fall on multiples of this many elements."""
        return QUANT_ALIGN if self.blockwise else default


@dataclass(frozen=True)
class StateRun:
    """Local range [local_start, local_start + numel) of one group and one moments format.

    ``side_start``: a run whose parameters keep fp32 moments inside a compressed state reads
    them at this offset of the fp32 side buffers (-1: in the main moment buffers).
    ``sr_index``: for each 256-element chunk of the run, the index in its parameter of the
    chunk's first element. ``pieces``: (param, param_offset, numel) of each joined piece."""

    local_start: int
    numel: int
    fmt: str
    group: int
    side_start: int
    sr_index: tuple[int, ...]
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def stop(self) -> int:
        return self.local_start + self.numel


@dataclass(frozen=True)
class RunPlan:
    runs: tuple[StateRun, ...]
    side_numel: int  # elements of each fp32 side buffer (one per buffer of the rule)
    starts: tuple[int, ...]  # runs' local_start, for bisection


def plan_runs(pieces: Sequence[object], param_numels: Sequence[int],
              fmt: StateFormat) -> RunPlan:
    """The runs of this rank's ``pieces`` (``zero.layout.Piece``: param, param_offset,
    local_start, numel, group; ordered by local_start) under ``fmt``.

    Raises:
        AssertionError: an int8 piece not on its parameter's block boundaries (the layout
            was not aligned for int8).
    """
    if fmt.in_place:
        big = [i for i, n in enumerate(param_numels) if n > 2**32]
        if big:  # the stochastic rounding counter holds an element index in 32 bits
            raise ValueError(f"master='none' supports parameters of up to 2**32 elements; "
                             f"parameter {big[0]} has {param_numels[big[0]]}")
    runs: list[StateRun] = []
    side = 0
    cur: dict | None = None

    def close() -> None:
        nonlocal side, cur
        if cur is None:
            return
        n = cur["numel"]
        side_start = -1
        if cur["fmt"] == "fp32" and fmt.moments != "fp32":
            side_start, side = side, side + n
        sr: list[int] = []
        for chunk in range(0, n, BLOCK):
            pos = cur["start"] + chunk
            for _p, off, k, ls in cur["pieces"]:
                if ls <= pos < ls + k:
                    sr.append(off + pos - ls)
                    break
        runs.append(StateRun(cur["start"], n, cur["fmt"], cur["group"], side_start, tuple(sr),
                             tuple((p, off, k) for p, off, k, _ in cur["pieces"])))
        cur = None

    for pc in pieces:
        param, off, ls, k, group = (pc.param, pc.param_offset, pc.local_start,  # type: ignore
                                    pc.numel, pc.group)  # type: ignore[attr-defined]
        if param < 0 or k == 0:
            close()  # a frozen parameter's hole (stage 3) ends a run
            continue
        f = fmt.effective(param_numels[param])
        if stored_type(f).blockwise:
            assert off % BLOCK == 0 and ls % BLOCK == 0, (
                f"int8 piece of parameter {param} at offset {off}, local {ls}: not on a "
                f"{BLOCK}-element block (layout not aligned for int8 moments)")
        joins = (cur is not None and cur["fmt"] == f and cur["group"] == group
                 and cur["start"] + cur["numel"] == ls and cur["pieces"][-1][2] % BLOCK == 0)
        if not joins:
            close()
            cur = {"start": ls, "numel": 0, "fmt": f, "group": group, "pieces": []}
        assert cur is not None
        cur["pieces"].append((param, off, k, ls))
        cur["numel"] += k
    close()
    return RunPlan(tuple(runs), side, tuple(r.local_start for r in runs))
