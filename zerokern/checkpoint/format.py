"""On-disk format of a zerokern checkpoint, and the file-level machinery every part shares.

A checkpoint is a directory::

    PATH/
      meta.json                  written LAST: what is in the checkpoint and where
      rank00000.safetensors      what rank 0 owned: fp32 master values, exp_avg, exp_avg_sq
      rank00001.safetensors      ... one file per saving rank (on a 2-D mesh: per shard rank,
                                 written by the first replica; meta.json's ``mesh`` entry
                                 records the mesh shape, for information only)

Each rank file holds 1-D tensors ``master``, ``exp_avg``, ``exp_avg_sq`` (fp32, the same
length): the pieces of parameters the rank owned, compacted one after another (no padding, no
holes for frozen parameters). ``frozen.<dtype>`` holds values of parameters the optimizer does
not manage (frozen, or left out of it), ``buffer/<name>`` a persistent buffer (rank 0 only).
``meta.json`` maps every element back to its parameter: per file, a piece table of
``[param name, param offset, numel, tensor, offset in tensor]`` rows (tensor "state" means the
master/exp_avg/exp_avg_sq triple), plus sizes and sha256 of every file.

A compressed optimizer state adds a top-level ``state_format`` entry and, unless its moments
are fp32, a ``moments`` table per file with the moments in per-format tensors; ``master`` then
holds the values as stored (bf16 parameters for ``master="none"``). moments.py has the
details; a default state is written exactly as before.

This module knows nothing of ZeroAdamW: a streaming safetensors writer (no copy of the data),
header parsing with validation, the piece index ("which byte ranges hold elements [lo, hi) of
parameter X") and atomic publication of a directory. meta.json checks are in validate.py.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import hashlib
import json
import math
import os
import re
import shutil
import stat
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

FORMAT = "zerokern-checkpoint"
FORMAT_VERSION = 2  # 2: meta.json carries meta_sha256 (1: without it, still read)
META = "meta.json"
CHUNK_BYTES = 64 << 20  # reads and writes of one tensor are cut into pieces of this size
_MAX_HEADER = 256 << 20

# fmt: off
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
# fmt: on
CODES = {v: k for k, v in DTYPES.items()}


META_DIGEST = "meta_sha256"


def meta_digest(meta: dict[str, Any]) -> str:
    """sha256 of meta.json's content without its own digest entry, in a canonical JSON form
    (sorted keys, no spaces): what a load recomputes to detect edits of meta.json, which no
    file checksum covers."""
    body = {k: v for k, v in meta.items() if k != META_DIGEST}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


class CheckpointError(RuntimeError):
    """The checkpoint is missing, incomplete or corrupt, or does not fit the model; the message
    names the file at fault. Nothing was modified when this is raised by load_checkpoint."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in {META}")
    return dt


# -- durable files ----------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write to ``path.partial``, flush, fsync, rename: ``path`` is absent or complete."""
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _byte_view(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


# -- safetensors, written and read by hand ----------------------------------------------------
def safetensors_header(
    entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    metadata: dict[str, str] | None = None,
) -> tuple[bytes, list[int]]:
    """The 8-byte length + JSON header for tensors laid out in ``entries`` order, padded with
    spaces so the data starts on an 8-byte boundary; and each tensor's size in bytes."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    sizes, off = [], 0
    for name, dtype, shape in entries:
        if name in header or name == "__metadata__":
            raise ValueError(f"duplicate tensor name {name!r}")
        n = math.prod(int(s) for s in shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {
            "dtype": CODES[dtype],
            "shape": [int(s) for s in shape],
            "data_offsets": [off, off + n],
        }
        sizes.append(n)
        off += n
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js, sizes


class StreamWriter:
    """A safetensors file written tensor after tensor, chunk after chunk, without ever holding
    more than the chunk given: the header is computed from the shapes first. The data go to
    ``path.partial`` (sha256 computed on the way), which close() fsyncs and renames."""

    def __init__(
        self,
        path: str,
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path, self.tmp = path, path + ".partial"
        header, self._sizes = safetensors_header(entries, metadata)
        self._names = [e[0] for e in entries]
        self._dtypes = [e[1] for e in entries]
        self._i, self._left = 0, (self._sizes[0] if self._sizes else 0)
        self._hash = hashlib.sha256()
        self._f = open(self.tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self.nbytes = 0
        self._raw(memoryview(header))
        self._skip_empty()

    def _raw(self, buf: memoryview) -> None:
        self._f.write(buf)
        self._hash.update(buf)
        self.nbytes += buf.nbytes

    def _skip_empty(self) -> None:
        while self._i < len(self._sizes) and self._left == 0:
            self._i += 1
            self._left = self._sizes[self._i] if self._i < len(self._sizes) else 0

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append the next elements of tensor ``name`` (must be the tensor being written)."""
        if self._i >= len(self._names) or self._names[self._i] != name:
            cur = self._names[self._i] if self._i < len(self._names) else "nothing"
            raise ValueError(f"{self.path}: writing {name!r} but {cur!r} is due")
        if chunk.dtype != self._dtypes[self._i]:
            raise ValueError(f"{self.path}: {name!r} is {self._dtypes[self._i]}, got {chunk.dtype}")
        buf = _byte_view(chunk)
        if buf.nbytes > self._left:
            raise ValueError(f"{self.path}: more bytes than {name!r} holds")
        self._raw(buf)
        self._left -= buf.nbytes
        self._skip_empty()

    def close(self) -> tuple[int, str]:
        if self._i < len(self._names):
            raise ValueError(f"{self.path}: {self._names[self._i]!r} not fully written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)
        return self.nbytes, self._hash.hexdigest()

    def abort(self) -> None:
        self._f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path``, never through a symbolic link
    (O_NOFOLLOW): a checkpoint's files are its own, not whatever a link points at."""
    name = os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise CheckpointError(
                f"{name} is a symbolic link ({path}): the files of a checkpoint must be "
                f"regular files inside its directory"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{name} is not a regular file ({path})")
    return fd


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check a safetensors header against the file: every tensor's byte range in
    bounds, contiguous, ending exactly at the end of the file (so truncation is detected)."""
    name = os.path.basename(path)

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{name} is corrupt or truncated ({path}): {why}")

    with os.fdopen(open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than a safetensors header")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, _MAX_HEADER):
            raise bad(f"header length {n} does not fit in a file of {size} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise bad(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise bad("__metadata__ is not a JSON object")
    out: dict[str, TensorInfo] = {}
    try:
        for key, d in header.items():
            dt = DTYPES[d["dtype"]]
            shape = tuple(d["shape"])
            b, e = d["data_offsets"]
            # JSON integers only: int("12") or int(1.5) would accept what no writer produces.
            if not all(is_count(x) for x in (*shape, b, e)) or b > e:
                raise bad(f"tensor {key!r}: shape and data_offsets must be integers >= 0")
            if e - b != math.prod(shape) * torch.empty(0, dtype=dt).element_size():
                raise bad(f"tensor {key!r}: byte range does not match its shape")
            out[key] = TensorInfo(dt, shape, 8 + n + b, 8 + n + e)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise bad(f"malformed header entry ({exc!r})") from None
    pos = 8 + n
    for t in sorted(out.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != pos:
            raise bad("tensor data are not contiguous")
        pos = t.end
    if pos != size:
        raise bad(f"the header describes {pos} bytes, the file has {size}")
    return out, meta


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


# -- where each parameter's elements are --------------------------------------------------------
def is_count(v: Any) -> bool:
    """A JSON integer >= 0: not a float (1.0, 1.5), not a bool (True is an int to Python)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


STATE = ("master", "exp_avg", "exp_avg_sq")  # the tensors behind piece kind "state"
FROZEN_KINDS = {f"frozen.{dtype_name(dt)}": dt for dt in DTYPES.values()}
PIECE_ROW = "[param name, param offset, numel, tensor, offset in tensor]"


@dataclass(frozen=True)
class Span:
    param_offset: int
    numel: int
    file: str
    tensor: str  # "state" (master/exp_avg/exp_avg_sq) or "frozen.<dtype>"
    offset: int
    row: str = ""  # where meta.json has it, "files[i].pieces[j]", for messages


def piece_row(row: Any, at: str) -> tuple[str, int, int, str, int]:
    """One row of a piece table, checked for form: a known tensor kind and integer offsets
    and sizes >= 0 (a negative or fractional one would read another parameter's values, or
    fail half-way through copying)."""
    if not (isinstance(row, list) and len(row) == 5):
        raise CheckpointError(f"{at} must be a row {PIECE_ROW}, got {row!r:.80}")
    name, po, n, tensor, off = row
    if not isinstance(name, str):
        raise CheckpointError(f"{at}: the param name must be a string, got {name!r:.80}")
    for what, v in (("param offset", po), ("numel", n), ("offset in tensor", off)):
        if not is_count(v):
            raise CheckpointError(f"{at}: the {what} must be an integer >= 0, got {v!r:.80}")
    if tensor != "state" and tensor not in FROZEN_KINDS:
        raise CheckpointError(
            f"{at}: the tensor must be 'state' or 'frozen.<dtype>', got {tensor!r:.80}"
        )
    return name, po, n, tensor, off


class PieceIndex:
    """Every saved piece by parameter name, sorted by offset within the parameter. Rows are
    checked for form here; check() checks that they tile the parameters."""

    def __init__(self, meta: dict[str, Any], where: str = META) -> None:
        self.where = where
        self.by_name: dict[str, list[Span]] = {}
        for i, f in enumerate(meta["files"]):
            for j, row in enumerate(f["pieces"]):
                at = f"files[{i}].pieces[{j}]"
                name, po, n, tensor, off = piece_row(row, f"{where}: {at}")
                if n:  # an empty parameter's row covers nothing
                    span = Span(po, n, f["name"], tensor, off, at)
                    self.by_name.setdefault(name, []).append(span)
        for spans in self.by_name.values():
            spans.sort(key=lambda s: s.param_offset)
        self._starts = {k: [s.param_offset for s in v] for k, v in self.by_name.items()}

    def check(self, params: dict[str, dict[str, Any]]) -> None:
        """Each parameter's elements (numel from its shape) are covered exactly once, by one
        kind of tensor, and no piece names an unknown parameter or lies outside its own."""
        w = self.where
        for name, spans in self.by_name.items():
            if name not in params:
                raise CheckpointError(
                    f"{w}: {spans[0].row} holds pieces of {name!r}, which is not a parameter"
                )
        for name, p in params.items():
            numel, pos = math.prod(p["shape"]), 0
            spans = self.by_name.get(name, [])
            for s in spans:
                if s.param_offset + s.numel > numel:
                    raise CheckpointError(
                        f"{w}: {s.row} holds elements [{s.param_offset}, "
                        f"{s.param_offset + s.numel}) of {name!r}, which has {numel}"
                    )
                if s.param_offset != pos:
                    raise CheckpointError(
                        f"{w}: the pieces of {name!r} leave a gap or overlap at element "
                        f"{pos} ({s.row}, in {s.file})"
                    )
                pos += s.numel
            if pos != numel:
                raise CheckpointError(
                    f"{w}: the pieces of {name!r} cover {pos} of its {numel} elements"
                )
            if len({s.tensor for s in spans}) > 1:
                raise CheckpointError(f"{w}: {name!r} is stored in more than one tensor kind")

    def kind(self, name: str) -> str | None:
        spans = self.by_name.get(name)
        return spans[0].tensor if spans else None

    def spans(self, name: str, lo: int, hi: int) -> Iterator[tuple[int, str, str, int, int]]:
        """(offset relative to lo, file, tensor kind, begin, end) for elements [lo, hi)."""
        spans, starts = self.by_name.get(name, []), self._starts.get(name, [])  # [] if empty
        k = max(bisect.bisect_right(starts, lo) - 1, 0)
        while k < len(spans) and spans[k].param_offset < hi:
            s = spans[k]
            a, b = max(lo, s.param_offset), min(hi, s.param_offset + s.numel)
            if a < b:
                d = s.offset - s.param_offset
                yield a - lo, s.file, s.tensor, a + d, b + d
            k += 1


def chunks(begin: int, end: int, element_size: int) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // element_size)
    for a in range(begin, end, step):
        yield a, min(end, a + step)


# -- publishing a directory atomically ----------------------------------------------------------
_NONCE = re.compile(r"\.(tmp|old)-[0-9a-f]{16}$")


def tmp_dir(path: str, nonce: str) -> str:
    return f"{path}.tmp-{nonce}"


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}")


def remove_checkpoint_dir(path: str) -> None:
    """Invalidate first (meta.json goes), then delete: never a half-deleted 'complete' one."""
    meta = os.path.join(path, META)
    if os.path.exists(meta):
        os.unlink(meta)
    shutil.rmtree(path, ignore_errors=True)


def publish(tmp: str, path: str, nonce: str) -> None:
    """Make the complete directory ``tmp`` the checkpoint at ``path``.

    With RENAME_EXCHANGE (Linux, most local filesystems) ``path`` switches from the old to the
    new checkpoint in one atomic step. Otherwise: rename old to ``path.old-<nonce>``, rename new
    to ``path``; a crash between the two leaves no ``path`` but two complete siblings, and
    load.resolve (used by load_checkpoint) picks the newer one."""
    fsync_dir(tmp)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(path):
        os.rename(tmp, path)
        fsync_dir(parent)
        return
    if _exchange(tmp, path):
        fsync_dir(parent)
        remove_checkpoint_dir(tmp)  # now holds the previous checkpoint
        return
    old = f"{path}.old-{nonce}"
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except Exception:  # an error, not a kill: put the previous one back
        os.rename(old, path)
        raise
    fsync_dir(parent)
    remove_checkpoint_dir(old)


def siblings(path: str) -> list[str]:
    parent, base = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    return [
        os.path.join(parent, n)
        for n in names
        if n.startswith(base + ".") and _NONCE.fullmatch(n[len(base) :])
    ]
