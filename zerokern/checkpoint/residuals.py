"""Error feedback's residuals in a checkpoint (``error_feedback=True``; comm/quantized_parts.py).

Each rank's residuals are its own (what its quantized sends missed), on a 2-D mesh too, where
the replicas otherwise hold the same state: so every rank of the team writes them, to
``ef_residual.<team rank>.pt`` (``torch.save`` of {slice label: fp32 tensor}), and meta.json
names them in its optional ``ef_residual`` entry: the team's size and mesh shape they were
saved at, the file names and each file's sha256 (meta.json's own digest covers them).

A load restores them only where they mean the same thing: an optimizer with error feedback,
the same team size and mesh shape, and, slice by slice, the same label and size. Otherwise they
are dropped and the residuals start from zero, as after a checkpoint saved without them: a
residual is at most one step's quantization error, and the next sends rebuild it. An
optimizer without error feedback ignores them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .format import sha256_file

RESIDUALS = "ef_residual"
"""meta.json's optional entry naming the residual files."""


def residual_file(team_rank: int) -> str:
    """The file of team rank ``team_rank``'s residuals."""
    return f"ef_residual.{team_rank:05d}.pt"


def feedback_part(opt: Any) -> Any:
    """The optimizer's gradient-reduce part when it runs error feedback, else None (also
    before stages 1-2 built their engine at the first step: nothing was sent yet)."""
    rt = getattr(opt, "_rt", None)
    if rt is not None:
        part = rt.ctx.grad_comm
    else:
        engine = getattr(getattr(opt, "_slot", None), "engine", None)
        part = getattr(engine, "grad_comm", None)
    return part if getattr(part, "feedback", False) else None


def residual_entry(opt: Any, team: Any) -> dict[str, Any] | None:
    """meta.json's ``ef_residual`` entry (None without error feedback)."""
    if feedback_part(opt) is None:
        return None
    rep = getattr(opt.comm, "replicate", None)
    return {"ranks": team.world_size,
            "mesh": None if rep is None else [rep.world_size, opt.comm.world_size],
            "files": [residual_file(r) for r in range(team.world_size)]}


def write_residuals(tmp: str, team_rank: int, opt: Any) -> str:
    """This rank's residuals into the staging directory ``tmp``; returns the file's sha256."""
    part = feedback_part(opt)
    saved = {} if part is None else {k: v.detach().cpu().clone()
                                     for k, v in part.residuals.items()}
    path = os.path.join(tmp, residual_file(team_rank))
    torch.save(saved, path)
    return sha256_file(path)


def residual_entry_error(entry: Any) -> str | None:
    """What is wrong with a meta.json ``ef_residual`` entry, or None."""
    if not isinstance(entry, dict) or set(entry) != {"ranks", "mesh", "files", "sha256"}:
        return f"must hold ranks, mesh, files and sha256, got {entry!r}"
    n, files, sums = entry["ranks"], entry["files"], entry["sha256"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 \
            or files != [residual_file(r) for r in range(n)]:
        return f"ranks {n!r} and files {files!r} do not match"
    if not isinstance(sums, list) or len(sums) != n or not all(
            isinstance(d, str) and len(d) == 64 for d in sums):
        return f"sha256 must list {n} hex digests, got {sums!r}"
    return None


def load_residuals(ckpt: str, meta: dict[str, Any], opt: Any, team: Any) -> bool:
    """Restore this rank's residuals from ``ckpt`` where they apply (module docstring), else
    start from zero. Returns whether they were restored."""
    part = feedback_part(opt)
    if part is None:
        return False
    part.residuals.clear()
    part.restored.clear()
    entry = meta.get(RESIDUALS)
    rep = getattr(opt.comm, "replicate", None)
    mesh = None if rep is None else [rep.world_size, opt.comm.world_size]
    if entry is None or entry["ranks"] != team.world_size or entry["mesh"] != mesh:
        return False
    path = os.path.join(ckpt, residual_file(team.rank))
    if sha256_file(path) != entry["sha256"][team.rank]:
        # A corrupt residual would be added into every later send: refused, never guessed.
        raise ValueError(f"{residual_file(team.rank)} is corrupt ({path}): its sha256 does "
                         "not match meta.json's ef_residual entry")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    # Taken by the slice of the same label and size at its first send (moved to its device
    # then); a slice laid out otherwise starts from zero.
    part.restored.update(saved)
    return True
