"""Where the ranks of a single-machine process group meet: a file, not a port.

A port found free by binding and releasing it can be taken by another process before the
group's store binds it again, a race that fails the start on a busy machine. A file
rendezvous (``init_method="file://..."``) in a directory of one's own has no such race. The
tests' rank pool and the benchmarks form their groups this way, through this one helper.
"""

from __future__ import annotations

import os
import uuid


def file_init_method(directory: str | os.PathLike[str]) -> str:
    """A ``file://`` init_method for ``torch.distributed.init_process_group`` naming a new file
    in ``directory`` (which must exist and be reachable by every rank).

    Nothing is created here: the ranks create the file. Each call names a different file,
    because torch's file store must not find the leftovers of an earlier group (a group that
    died does not remove its file). The path is written as is, not percent-encoded as
    ``Path.as_uri`` would: torch does not decode it on POSIX.
    """
    path = os.path.join(os.path.abspath(directory), f"rendezvous-{uuid.uuid4().hex}")
    return f"file://{path}"
