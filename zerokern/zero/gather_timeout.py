"""How long a stage-3 rank waits in a unit's collective before it is told why it is stuck.

At stage 3 every forward (evaluation too), backward, ``model.state_dict()`` and
``full_state_dict()`` gathers each unit's parameters from all ranks. A script that evaluates
under ``if rank == 0:`` (nanoGPT's habit, harmless with DDP) leaves rank 0 waiting in a gather
the others never start: with torch's defaults, 30 minutes of silence until the process group
times out. The stage-3 runtime instead bounds each wait (the time this rank spends waiting
for the others in one collective, not the time since the step began: a slow first step or a
long data load on another rank only delays the wait, it does not accumulate) and raises
CollectiveTimeout naming the unit and the likely cause.

On gloo a wait blocks the calling thread anyway, so the bound costs nothing and is on by
default. On NCCL a wait only orders streams; a bounded wait blocks the host until the
collective completes, so it applies only when asked for explicitly (NCCL's own watchdog
timeout applies otherwise).

The same limit (``$ZEROKERN_GATHER_TIMEOUT``) bounds each all-reduce of an optimizer's
``full_state_dict()`` at stages 1-3 (interchange.py), which nanoGPT's checkpoint, ported,
runs under ``if master_process:`` on rank 0 alone, and the first agreement of
``save_checkpoint`` / ``load_checkpoint`` (checkpoint/arrival.py), for the same habit.
"""

from __future__ import annotations

import math
import os

ENV = "ZEROKERN_GATHER_TIMEOUT"
DEFAULT_S = 300.0  # a few minutes: far above any gather, far below the 30 of torch's default


def resolve(value: float | None) -> tuple[float, bool]:
    """(seconds, given explicitly) from shard_model's ``gather_timeout`` or, when it is None,
    ``$ZEROKERN_GATHER_TIMEOUT``, else the default. ``math.inf`` turns the bound off."""
    source = "gather_timeout"
    explicit = value is not None
    if value is None:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return DEFAULT_S, False
        source, explicit = f"${ENV}", True
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{source} must be a number of seconds > 0 (or inf), got "
                             f"{raw!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or value <= 0:
        raise ValueError(f"{source} must be a number of seconds > 0 (or math.inf for no "
                         f"limit), got {value!r}")
    return float(value), explicit


def wait_limit(seconds: float, explicit: bool, backend: str) -> float | None:
    """The timeout to pass to Handle.wait (None: wait as long as the backend does)."""
    if math.isinf(seconds):
        return None
    if "nccl" in backend and not explicit:
        return None
    return seconds


def message(rank: int, world: int, what: str, unit: str, waited: float, limit: float) -> str:
    return (
        f"ZeroAdamW stage 3 (shard_model): rank {rank} of {world} waited {waited:.1f} s in "
        f"the {what} of unit {unit!r} and the other ranks did not join it. At stage 3 every "
        f"forward (evaluation too), backward, model.state_dict() and "
        f"zerokern.full_state_dict() gathers the parameters from all ranks, so each must run "
        f"on every rank. Likely cause: a forward (evaluation) or state_dict run on some ranks "
        f"only, e.g. under `if rank == 0:`. Run it on every rank, or evaluate a plain "
        f"(unsharded) copy of the model on rank 0 alone: zerokern.load_checkpoint(path, "
        f"plain_model, None), or plain_model.load_state_dict(zerokern.full_state_dict(model)) "
        f"with full_state_dict called on every rank; put torch.distributed.barrier() after "
        f"such rank-0-only work, so that the other ranks wait there (under the process "
        f"group's own timeout) rather than in a gather. Or a unit whose forward runs on some "
        f"ranks only: a mixture-of-experts expert made a unit (unit_classes), called only "
        f"where it got tokens; make the block that holds the experts the unit. If a rank was "
        f"only busy for longer "
        f"(writing a checkpoint, a slow first step), raise the limit: "
        f"shard_model(..., gather_timeout=SECONDS) or {ENV}=SECONDS (now {limit:g} s). The "
        f"collective is still pending, so the process group cannot be used again: end the "
        f"process.")
