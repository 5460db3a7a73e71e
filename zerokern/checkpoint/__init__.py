"""Crash-safe checkpoints that load at any world size and stage.

``save_checkpoint(path, model, optimizer, extra=None)`` (every rank) writes a directory: one
safetensors file per rank with only what that rank owns (fp32 master values and both Adam
moments of its pieces, compacted), plus ``meta.json``, written last by rank 0, which maps every
saved element to (parameter name, offset) and records sizes and sha256 of every file, shapes,
dtypes, per-parameter step counts, param-group hyperparameters, loss-scaler state, versions and
``extra``. The directory is built under a temporary name and published with an atomic rename,
so ``path`` always holds a complete checkpoint (the previous one until the new one is whole).

``load_checkpoint(path, model, optimizer)`` (every rank) refuses a missing, incomplete or
corrupt checkpoint with an error naming the file before touching anything, then reads, through
memory-mapped safetensors slices, only the ranges its own new layout needs, at any world size
and stage (16-bit parameters are re-derived from the fp32 master by round-to-nearest-even, as
ZeroAdamW derives them). ``python -m zerokern consolidate PATH OUT`` turns a checkpoint into a
plain fp32 state dict (and a torch.optim.AdamW state dict), one parameter at a time.
See format.py for the layout on disk.

With hybrid sharding (``ZeroAdamW(mesh=)``, a 2-D mesh) the saved layout is the shard group's:
the first replica writes one file per shard rank, the others write nothing but still call
save_checkpoint (errors are agreed on, and it returns, over the whole mesh); on load every
replica reads its shard rank's ranges. A checkpoint moves freely between flat and mesh runs
and world sizes: only the files and their pieces matter, not the mesh that saved them.

A compressed state (``ZeroAdamW(moments="int8" | "bf16", master="none")``) is saved as it is
stored (int8 codes with one absmax per 256-element block of the parameter, bf16 moments as
bf16, small parameters' fp32 moments as fp32; with ``master="none"`` the bf16 parameters are
the values and the stochastic-rounding seed is saved): it reloads bit for bit at any world size
and stage, and loads into another format through fp32. See moments.py.
"""

from .format import CheckpointError
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]
