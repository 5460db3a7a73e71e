"""A ZeroStrategy checkpoint directory as one Lightning checkpoint file.

``trainer.save_checkpoint`` and ``ModelCheckpoint`` under ZeroStrategy write directories (every
rank its part), which what reads one ``torch.save`` file cannot open:
``LightningModule.load_from_checkpoint(best_model_path)`` raises ``IsADirectoryError``, as it
does for DeepSpeed's checkpoints (Lightning's ``convert_zero_checkpoint_to_fp32_state_dict``).
``to_lightning_checkpoint`` writes the file those read: the full weights, consolidated from
any stage and world size, and Lightning's own state as it was saved.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from ..checkpoint.load import open_checkpoint
from ..cli.consolidate import consolidate


def to_lightning_checkpoint(path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                            weights_only: bool | None = None) -> str:
    """Write the ZeroStrategy checkpoint directory ``path`` as one Lightning checkpoint file
    ``out``, e.g. for ``MyModule.load_from_checkpoint(out)``.

    The file holds Lightning's checkpoint dict as ``trainer.save_checkpoint`` made it (epoch,
    global_step, hyperparameters, loops, callbacks, LR schedulers), with ``state_dict`` the
    full fp32 weights and buffers (``python -m zerokern consolidate``'s, whatever the stage
    and world size) and no optimizer state (``optimizer_states`` empty: resume the fit from
    the directory itself). One process reads the directory; no process group is needed.

    Args:
        path: the checkpoint directory (``ModelCheckpoint.best_model_path``, ...).
        out: the file to write (written whole, then renamed into place).
        weights_only: how Lightning's part of the checkpoint is unpickled, as
            ``torch.load``'s argument of that name (default: torch's).

    Returns:
        ``out``.

    Raises:
        CheckpointError: ``path`` is not a complete zerokern checkpoint.
        ValueError: it is one, but not written by ZeroStrategy.
    """
    from safetensors.torch import load_file

    from .lightning import _EXTRA_FORMAT, EXTRA_KEY, _decode

    path, out = os.fspath(path), os.fspath(out)
    ck = open_checkpoint(path, verify=False)  # consolidate verifies the files below
    extra = ck.meta.get("extra")
    entry = extra.get(EXTRA_KEY) if isinstance(extra, Mapping) else None
    if not isinstance(entry, Mapping) or "state" not in entry:
        raise ValueError(f"to_lightning_checkpoint: {path} holds no Lightning state (not "
                         "written by ZeroStrategy); use python -m zerokern consolidate for "
                         "its weights")
    if entry.get("format") != _EXTRA_FORMAT:
        raise ValueError(f"to_lightning_checkpoint: {path} holds Lightning state of format "
                         f"{entry.get('format')!r}; this version reads {_EXTRA_FORMAT}")
    state: dict[str, Any] = _decode(entry["state"], weights_only)
    folder = os.path.dirname(os.path.abspath(out))
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        weights = os.path.join(tmp, "model.safetensors")
        consolidate(path, weights)
        state["state_dict"] = load_file(weights)
        state["optimizer_states"] = []
        partial = os.path.join(tmp, "checkpoint.partial")
        torch.save(state, partial)
        os.replace(partial, out)
    return out


__all__ = ["to_lightning_checkpoint"]
