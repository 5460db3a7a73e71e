"""What the benches' fork server imports before it forks any rank (bench/_harness.py)."""

import gc

import torch  # noqa: F401

# What the import made is frozen (left out of every collection, as CPython's docs advise
# before forking workers): a rank's collections would otherwise traverse the whole inherited
# heap and, writing the objects' headers, copy every page of it.
gc.freeze()
