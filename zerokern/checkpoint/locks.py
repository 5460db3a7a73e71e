"""Advisory locks that keep concurrent saves and loads of one checkpoint path apart.

- ``PATH.lock`` (a file next to the checkpoint, never deleted): a save holds it exclusively
  while it publishes its directory and removes what is stale; a load holds it shared from
  reading meta.json to the last byte of data. So a reader never sees a directory swapped or
  deleted under it, and two saves never publish or clean up at the same time.
- ``PATH.tmp-<nonce>/.owner``: the save that staged the directory keeps it locked until it
  is done. A staging directory whose owner lock can be taken belongs to a save that died:
  only such directories are removed by a later save, never a live save's.

``fcntl.flock``: local filesystems, and NFS where the kernel maps it to byte-range locks.
Where locks are unavailable (no fcntl, or a read-only directory for a reader) the operations
run unlocked, as before.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

OWNER = ".owner"


def lock_file(path: str) -> str:
    return f"{path}.lock"


@contextmanager
def _flock(target: str, exclusive: bool, create: bool = True) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(target, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except OSError:
        if exclusive:
            raise  # a save must be able to lock what it publishes
        yield  # a reader, and no save has ever locked this path (or it is read-only)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def reading(path: str) -> Iterator[None]:
    """Held by a load of ``path`` from its first read to its last. A load creates no file: a
    checkpoint that no save of this zerokern ever locked (copied in, read-only) has no lock
    file, and a save creates it before it stages anything."""
    with _flock(lock_file(path), exclusive=False, create=False):
        yield


@contextmanager
def publishing(path: str) -> Iterator[None]:
    """Held by a save of ``path`` while it swaps its directory in and cleans up."""
    with _flock(lock_file(path), exclusive=True):
        yield


class StagingClaim:
    """The owner lock of a staging directory, held by the save that made it until it ends."""

    def __init__(self, directory: str) -> None:
        self.fd: int | None = None
        if fcntl is None:
            return
        self.fd = os.open(os.path.join(directory, OWNER), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def abandoned(directory: str) -> bool:
    """True when ``directory`` (a staging directory) belongs to no live save: its owner lock
    can be taken, or it has no owner file (a save of an older zerokern, or one killed before
    it wrote the file: both are past)."""
    if fcntl is None:
        return False  # cannot tell: keep it
    try:
        fd = os.open(os.path.join(directory, OWNER), os.O_RDWR)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: a save is using it
    finally:
        os.close(fd)
    return True
