"""The first agreement of save_checkpoint and load_checkpoint, bounded: a rank that calls one
alone is told so instead of waiting silently.

A script ported from DDP (nanoGPT) saves under ``if master_process:``. Both functions are
collectives: each rank writes (or reads) the part of the state it holds, and the ranks agree
after each phase (save.py, load.py). Rank 0 calling alone would wait in the first agreement
until the process group's own timeout (30 minutes by default, in silence), since torch's
object collectives take no timeout. That first agreement is where a missing rank shows: no
collective runs before it, and once it completes every rank is known to be inside the call.
So it alone is bounded, by the stage-3 gathers' limit (``$ZEROKERN_GATHER_TIMEOUT``,
zero/gather_timeout.py: on gloo by default, on NCCL only when the variable is set), and its
timeout is raised as a CollectiveTimeout naming the call and the fix. The later agreements
wait for I/O of very different lengths on different ranks (save: writing each rank's file)
and stay unbounded, so that a slow disk does not trip the limit. Save's first agreement
follows the planning only (no I/O but the staging directory); load's follows the checks of
the files, with ``verify=True`` their sha256 (rank r hashes files r, r+N, ...): the ranks
differ there by at most one file's hashing, far below the default 300 s unless a rank file
holds tens of GB on a slow disk (then raise the limit).
"""

from __future__ import annotations

from typing import Any

from ..comm import CollectiveTimeout
from ..zero import gather_timeout as told

_WHY = {
    "save_checkpoint": (
        "each rank writes the part of the model and optimizer state it holds, and rank 0 "
        "publishes the directory once all have written, so no rank-0 guard is needed"
    ),
    "load_checkpoint": (
        "each rank reads the part of the state it holds. To evaluate on rank 0 alone, load "
        "into a plain, unsharded copy of the model, which needs no other rank: "
        "zerokern.load_checkpoint(path, plain_model, None)"
    ),
}


def limit(team: Any) -> float | None:
    """How long a rank waits in the first agreement (None: as long as the backend does).
    Resolved before anything is done, so that a malformed ``$ZEROKERN_GATHER_TIMEOUT`` is
    refused before a staging directory exists."""
    if team.world_size == 1:
        return None
    return told.wait_limit(*told.resolve(None), team.comm.backend)


def first_agreement(
    team: Any, obj: Any, label: str, wait: float | None, call: str, path: str
) -> list[Any]:
    """``team.all_gather_object(obj, label)`` with each wait bounded by ``wait`` seconds; its
    timeout becomes a CollectiveTimeout that names ``call`` on ``path`` and what to do."""
    try:
        return team.all_gather_object(obj, label, wait)
    except CollectiveTimeout as exc:
        raise CollectiveTimeout(
            message(call, path, team.rank, team.world_size, label, exc.waited, wait), exc.waited
        ) from exc


def message(
    call: str, path: str, rank: int, world: int, label: str, waited: float, wait: float | None
) -> str:
    return (
        f"{call}({path}): rank {rank} of {world} waited {waited:.1f} s in the all-gather of "
        f"the {label} and the other ranks did not join it. {call} is a collective: every "
        f"rank must call it, at the same point of the script, not rank 0 alone under `if "
        f"master_process:` or `if rank == 0:`; {_WHY[call]}. See docs/checkpoints.md and "
        f"docs/troubleshooting.md. If a rank was only busy for longer, raise the limit: "
        f"{told.ENV}=SECONDS (now {wait:g} s). The collective is still pending, so the "
        f"process group cannot be used again: end the process."
    )
