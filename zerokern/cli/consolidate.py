"""``python -m zerokern consolidate PATH OUT [--optimizer OUT_OPT]``: a zerokern checkpoint (any
world size, any stage) to a plain fp32 ``state_dict`` in one safetensors file, and optionally a
``torch.optim.AdamW`` state dict (``torch.save`` format).

Memory: the model file is streamed: its header is computed from the shapes in meta.json, then
each tensor's bytes are read from the rank files with ``pread`` and written in chunks of at most
64 MiB (format.CHUNK_BYTES), so the peak is a constant, whatever the size of the model or of its
largest parameter. The optimizer file is written with torch's own zip writer, one tensor record
at a time (stream_torch_save): a record must be written whole, so its peak is one moment
of the largest parameter, read straight into place.

Safety, all decided before the first byte is written: OUT and OUT_OPT (their resolved real
paths, and those of their ``.partial`` files) must lie outside the checkpoint directory and
differ from each other; the memory the largest allocation needs and the bytes of both files
must fit in what is available; the checkpoint is read under its shared reader lock (locks.py),
so a concurrent save cannot swap the directory mid-read. Every failure, including an
interrupt, removes the ``.partial`` files this run created.

    python -m zerokern consolidate ckpt/ model.safetensors --optimizer adamw.pt

then ``model.load_state_dict(safetensors.torch.load_file("model.safetensors"))`` and
``adamw.load_state_dict(torch.load("adamw.pt", weights_only=True))`` with AdamW built over the
same param groups as the ZeroAdamW that saved it (for one group over ``model.parameters()``:
indices follow ``model.parameters()``). The file holds only tensors and plain containers, so
``weights_only=True`` (which unpickles no arbitrary objects) loads it.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import pickle
import shutil
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpoint.format import (
    CHUNK_BYTES,
    META,
    CheckpointError,
    StreamWriter,
    chunks,
    dtype_from_name,
    read_header,
    safetensors_header,
)
from ..checkpoint.load import Opened, open_checkpoint
from ..checkpoint.locks import lock_file, reading
from ..checkpoint.moments import MOMENTS, MomentIndex, has_table, read_fp32_into

HELP = "turn a zerokern checkpoint into a plain fp32 state dict (+ AdamW state), streaming"
DESCRIPTION = (
    "Write the model of a zerokern checkpoint directory (saved at any world size and stage) as "
    "one safetensors state dict with fp32 parameters (tied names included, buffers in their "
    "dtype, floating ones as fp32), one chunk at a time; with --optimizer also a "
    "torch.optim.AdamW state dict loadable with torch.load(weights_only=True)."
)


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("path", metavar="PATH", help="checkpoint directory (save_checkpoint)")
    p.add_argument("out", metavar="OUT", help="output .safetensors file for the model")
    p.add_argument(
        "--optimizer",
        metavar="OUT_OPT",
        default=None,
        help="also write a torch.optim.AdamW state dict (torch.save format) here",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the sha256 check of the rank files (sizes are still checked)",
    )
    p.set_defaults(func=run)
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``consolidate`` on a dispatcher's ``add_subparsers()`` object."""
    p = subparsers.add_parser("consolidate", help=HELP, description=DESCRIPTION)
    return configure_parser(p)


# -- reading and writing, one tensor at a time -------------------------------------------------
class RangeReader:
    """Element ranges of a safetensors file read with pread into the caller's buffer: no
    memory map, whose touched pages would stay resident until the file is closed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tensors, self.metadata = read_header(path)
        self._fd = os.open(path, os.O_RDONLY)

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        t = self.tensors[name]
        out = torch.empty(max(hi - lo, 0), dtype=t.dtype)
        self.read_into(name, lo, out)
        return out

    def read_into(self, name: str, lo: int, dst: torch.Tensor) -> None:
        """Elements [lo, lo + dst.numel()) of ``name`` straight into ``dst`` (contiguous, CPU,
        the stored dtype): no intermediate buffer."""
        t, hi = self.tensors[name], lo + dst.numel()
        if not 0 <= lo <= hi <= t.numel or dst.dtype != t.dtype or not dst.is_contiguous():
            raise CheckpointError(
                f"{os.path.basename(self.path)}: cannot read elements [{lo}, {hi}) of {name!r} "
                f"({t.numel} elements of {t.dtype}) into a {dst.dtype} tensor"
            )
        if dst.numel() == 0:
            return
        view = memoryview(dst.view(torch.uint8).numpy()).cast("B")
        off = t.begin + lo * dst.element_size()
        got = 0
        while got < view.nbytes:
            k = os.preadv(self._fd, [view[got:]], off + got)
            if k <= 0:
                raise CheckpointError(f"{os.path.basename(self.path)}: unexpected end of file")
            got += k

    def close(self) -> None:
        os.close(self._fd)


class LazyTensor:
    """Stands for a tensor in an object given to ``stream_torch_save``: pickled exactly like a
    CPU tensor, its data produced by ``make()`` only when its record is written."""

    def __init__(
        self, shape: Sequence[int], dtype: torch.dtype, make: Callable[[], torch.Tensor]
    ) -> None:
        self.shape, self.dtype, self.make = tuple(int(s) for s in shape), dtype, make
        self.key: str | None = None

    def __reduce_ex__(self, protocol: int) -> Any:
        stride = tuple(int(s) for s in torch.empty(self.shape, device="meta").stride())
        return (
            torch._utils._rebuild_tensor_v2,
            (_StorageRef(self), 0, self.shape, stride, False, OrderedDict()),
        )


class _StorageRef:
    def __init__(self, t: LazyTensor) -> None:
        self.t = t


def stream_torch_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` where ``obj`` holds LazyTensors: the same pickle and zip
    records torch.save writes (loads with ``torch.load(weights_only=True)``), but each tensor is
    made, written and dropped in turn. Uses torch's zip writer (torch.serialization internals);
    if they are missing, falls back to materialising everything and calling torch.save."""
    tmp = path + ".partial"
    try:
        opener = torch.serialization._open_zipfile_writer
        alignment = str(torch.serialization._get_storage_alignment())
    except AttributeError:
        torch.save(_materialize(obj), tmp)
        _fsync_replace(tmp, path)
        return
    records: list[tuple[str, Callable[[], Any]]] = []
    seen: dict[int, str] = {}
    storage_types = torch.storage._dtype_to_storage_type_map()

    def lazy(t: LazyTensor) -> torch.Tensor:
        v = t.make().detach().to("cpu", t.dtype).contiguous()
        if tuple(v.shape) != t.shape:
            raise ValueError(f"tensor {t.key}: made {tuple(v.shape)}, expected {t.shape}")
        return v  # may view a larger buffer: only its own bytes are written

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, _StorageRef):  # as torch.save's persistent_id, for a LazyTensor
                t = o.t
                if t.key is None:
                    t.key = str(len(records))
                    records.append((t.key, lambda t=t: lazy(t)))
                st = getattr(torch, storage_types[t.dtype])
                return ("storage", st, t.key, "cpu", math.prod(t.shape))
            if isinstance(o, torch.storage.TypedStorage):  # a real (small) tensor
                key = seen.get(o._untyped_storage._cdata)
                if key is None:
                    key = seen[o._untyped_storage._cdata] = str(len(records))
                    u = o._untyped_storage.cpu()
                    records.append((key, lambda u=u: u))
                st = getattr(torch, o._pickle_storage_type())
                return ("storage", st, key, "cpu", o._size())
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    data = buf.getvalue()
    with opener(tmp) as zf:
        zf.write_record("data.pkl", data, len(data))
        zf.write_record(".format_version", "1", 1)
        zf.write_record(".storage_alignment", alignment, len(alignment))
        zf.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, make in records:
            v = make()
            if isinstance(v, torch.Tensor):  # its bytes: the first ones of its storage
                v = v if v.storage_offset() == 0 else v.clone()
                zf.write_record(f"data/{key}", v.untyped_storage(), v.numel() * v.element_size())
            else:
                zf.write_record(f"data/{key}", v, v.nbytes())
            del v
    _fsync_replace(tmp, path)


def _materialize(obj: Any) -> Any:
    if isinstance(obj, LazyTensor):
        # clone: make() may return a view of a buffer that the next make() reuses.
        return obj.make().to("cpu", obj.dtype).reshape(obj.shape).clone()
    if isinstance(obj, dict):
        return {k: _materialize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_materialize(v) for v in obj)
    return obj


def _fsync_replace(tmp: str, path: str) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class ConsolidateError(Exception):
    """A refusal before anything is written (an output that would overwrite the checkpoint or
    the other output, not enough memory or disk), or a write that failed and was cleaned up."""


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def _one_line(exc: BaseException) -> str:
    return str(exc).replace("\n", " ").strip() or type(exc).__name__


class _Source:
    """Reads parameter elements out of the rank files (pread, no memory map) into one scratch
    buffer that is reused: every tensor is written out before the next read, and one long-lived
    buffer does not fragment the heap the way a fresh allocation per chunk does."""

    def __init__(self, ck: Opened) -> None:
        self.ck, self.meta, self.readers = ck, ck.meta, {}
        self._scratch: Any = None
        # Compressed moments (int8 codes, bf16): read as fp32 through their tables.
        self.moments = MomentIndex(ck.meta, ck.dir) if has_table(ck.meta) else None

    def reader(self, fname: str) -> RangeReader:
        if fname not in self.readers:
            self.readers[fname] = RangeReader(os.path.join(self.ck.dir, fname))
        return self.readers[fname]

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            try:
                self._scratch = torch.empty(nbytes, dtype=torch.uint8)
            except (RuntimeError, MemoryError) as exc:  # torch's CPU allocator: RuntimeError
                raise ConsolidateError(
                    f"cannot allocate {_size(nbytes)}: {_one_line(exc)}"
                ) from None
        return self._scratch[:nbytes].view(dtype)

    def spans(self, name: str, what: str) -> Any:
        numel = math.prod(self.meta["params"][name]["shape"])
        for rel, fname, kind, a, b in self.ck.index.spans(name, 0, numel):
            tensor = kind if kind != "state" else ("master" if what == "values" else what)
            yield rel, self.reader(fname), tensor, a, b

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype ``name``'s values are stored in (fp32 master, or a frozen tensor's)."""
        for _, rd, tensor, _, _ in self.spans(name, "values"):
            return rd.tensors[tensor].dtype
        return torch.float32  # no elements: nothing is read

    def chunks(self, name: str, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """The values of ``name`` as ``dtype``, chunk after chunk (each valid until the next)."""
        for _, rd, tensor, a, b in self.spans(name, "values"):
            stored = rd.tensors[tensor].dtype
            for ca, cb in chunks(a, b, 4):
                buf = self.scratch(cb - ca, stored)
                rd.read_into(tensor, ca, buf)
                yield buf.to(dtype)

    def full(self, name: str, what: str) -> torch.Tensor:
        """A moment of ``name`` (fp32), read straight into the scratch buffer."""
        shape = self.meta["params"][name]["shape"]
        out = self.scratch(math.prod(shape), torch.float32)
        if self.moments is not None:  # dequantized or widened (checkpoint/moments.py)
            read_fp32_into(self.moments, lambda f, t, a, b: self.reader(f).read(t, a, b),
                           name, 0, out, what)
            return out.view(shape)
        for rel, rd, tensor, a, b in self.spans(name, what):
            rd.read_into(tensor, a, out.narrow(0, rel, b - a))
        return out.view(shape)

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self._scratch = None


# -- what will be written, and what it needs -----------------------------------------------------
@dataclass
class _Plan:
    """Everything consolidate will do, worked out from meta.json and the file headers before
    the first byte is written, with the memory and disk it needs."""

    entries: list[tuple[str, torch.dtype, list[int]]] = field(default_factory=list)  # file order
    sources: list[tuple[str, bool]] = field(default_factory=list)  # (canonical name, is param)
    metadata: dict[str, str] = field(default_factory=dict)
    model_bytes: int = 0
    largest: tuple[int, str] = (0, "nothing")  # the largest tensor of the model file
    adamw: Any = None  # the object stream_torch_save writes (None: no --optimizer)
    optimizer_bytes: int = 0  # an upper estimate of the .pt file
    # Memory held at once: the reused scratch buffer (as large as its largest use) plus the
    # largest short-lived one next to it (a dtype conversion, a buffer chunk).
    scratch: tuple[int, str] = (0, "nothing")
    transient: tuple[int, str] = (0, "nothing")

    @property
    def memory(self) -> int:
        return self.scratch[0] + self.transient[0]


# Per record of the optimizer file: its pickle entry, zip headers (local + central directory,
# zip64 fields) and the padding that aligns its data; generous, so the disk check errs safe.
_RECORD_OVERHEAD = 1024
_FILE_OVERHEAD = 1 << 20


def _shape(what: str, shape: Any) -> list[int]:
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise CheckpointError(f"{META}: {what} has an invalid shape {shape!r}")
    return shape


def _plan(src: _Source, with_optimizer: bool) -> _Plan:
    try:
        return _make_plan(src, with_optimizer)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        # open_checkpoint checked what loading needs; the rest of meta.json is checked here.
        raise CheckpointError(f"{META} in {src.ck.dir} is malformed ({exc!r})") from None


def _make_plan(src: _Source, with_optimizer: bool) -> _Plan:
    meta, plan = src.meta, _Plan()
    entries, sources = [], []
    for key in meta["state_dict_keys"]:  # tied names and buffers included, as state_dict()
        canon = meta["aliases"].get(key, key)
        info = meta["params"].get(canon) or meta["buffers"].get(canon)
        if info is None:
            raise CheckpointError(f"{META}: state dict key {key!r} is neither parameter nor buffer")
        dt = dtype_from_name(info["dtype"])
        shape = _shape(repr(key), info["shape"])
        entries.append((key, torch.float32 if dt.is_floating_point else dt, shape))
        sources.append((canon, canon in meta["params"]))
    # Wider elements first, so that every tensor starts aligned to its element size.
    order = sorted(range(len(entries)), key=lambda i: -entries[i][1].itemsize)
    plan.entries = [entries[i] for i in order]
    plan.sources = [sources[i] for i in order]
    plan.metadata = {
        "format": "pt",
        "source": "zerokern consolidate",
        "zerokern_version": meta.get("zerokern_version", ""),
    }
    header, sizes = safetensors_header(plan.entries, plan.metadata)
    plan.model_bytes = len(header) + sum(sizes)
    for (key, dt, shape), (canon, is_param), nbytes in zip(plan.entries, plan.sources, sizes):
        numel = math.prod(shape)
        plan.largest = max(plan.largest, (nbytes, f"{key!r}, shape {shape}"))
        if is_param:  # a chunk of at most CHUNK_BYTES // 4 stored elements, then converted
            n, stored = min(numel, CHUNK_BYTES // 4), src.stored_dtype(canon)
            plan.scratch = max(plan.scratch, (n * stored.itemsize, f"a chunk of {key!r}"))
            if stored != dt:
                plan.transient = max(plan.transient, (n * dt.itemsize, f"a chunk of {key!r}"))
            continue
        # The model file is laid out from meta.json's shapes: a buffer shape the file does not
        # back would be streamed from data that is not there (open_checkpoint may refuse it
        # already; this keeps consolidate safe on its own).
        fname = src.ck.buffer_file[canon]
        t = src.reader(fname).tensors.get(f"buffer/{canon}")
        want = dtype_from_name(meta["buffers"][canon]["dtype"])
        if t is None or list(t.shape) != shape or t.dtype != want:
            held = "nothing" if t is None else f"shape {list(t.shape)} of {t.dtype}"
            raise CheckpointError(
                f"{META} and {fname} disagree on buffer {canon!r}: {META} says shape {shape} "
                f"({numel} elements) of {want}, the file holds {held}"
            )
        n = min(numel, CHUNK_BYTES // dt.itemsize)  # read fresh, then converted
        held = n * t.dtype.itemsize + (n * dt.itemsize if t.dtype != dt else 0)
        plan.transient = max(plan.transient, (held, f"a chunk of buffer {key!r}"))
    if with_optimizer:
        _plan_adamw(src, plan)
    return plan


def adamw_defaults() -> dict[str, Any]:
    """AdamW's param-group defaults for the keys ZeroAdamW does not have (amsgrad, foreach,
    ...), from its signature: constructing one would import torch._dynamo (+150 MB resident)."""
    import inspect

    sig = inspect.signature(torch.optim.AdamW.__init__).parameters
    out = {
        k: v.default
        for k, v in sig.items()
        if k not in ("self", "params") and v.default is not inspect.Parameter.empty
    }
    if "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters:
        out["decoupled_weight_decay"] = True  # what AdamW passes to Adam
    return out


def _zip_writer_available() -> bool:
    """Whether stream_torch_save streams (else it materialises every tensor at once)."""
    s = torch.serialization
    return hasattr(s, "_open_zipfile_writer") and hasattr(s, "_get_storage_alignment")


def _plan_adamw(src: _Source, plan: _Plan) -> None:
    """{"state": {i: {"step", *MOMENTS}}, "param_groups": [...]} with i counting
    the parameters of the saved param groups in order, as torch's state_dict() numbers them;
    state only for parameters that took a step (torch creates it lazily, at the first one)."""
    defaults = adamw_defaults()
    meta = src.meta
    if "optimizer" in meta:  # another rule's buffers (checkpoint/optimizer_entry.py)
        raise CheckpointError(
            f"{src.ck.dir}: the checkpoint holds the state of {meta['optimizer']['class']}, "
            "not torch.optim.AdamW: consolidate its weights only, or load it with "
            "zerokern.load_checkpoint and take opt.full_state_dict() (the class's format)")
    state: dict[int, Any] = {}
    groups, k, data = [], 0, 0
    for g in meta["param_groups"]:
        ids = []
        for name in g["params"]:
            p = meta["params"][name]
            if p["managed"] and (p["step"] or 0) > 0:
                if src.ck.index.kind(name) not in ("state", None):
                    # Its moments would be read from its frozen values, silently wrong.
                    raise CheckpointError(
                        f"{META}: {name!r} has optimizer steps but no optimizer state is stored"
                    )
                shape = _shape(repr(name), p["shape"])
                nbytes = 4 * math.prod(shape)
                plan.scratch = max(plan.scratch, (nbytes, f"exp_avg of {name!r}, shape {shape}"))
                data += len(MOMENTS) * nbytes + 4
                state[k] = {"step": torch.tensor(float(p["step"]))}
                for what in MOMENTS:
                    state[k][what] = LazyTensor(
                        shape, torch.float32, lambda n=name, w=what: src.full(n, w)
                    )
            ids.append(k)
            k += 1
        hyper = {
            kk: tuple(v) if isinstance(defaults.get(kk), tuple) else v
            for kk, v in g["hyper"].items()
        }
        groups.append({**defaults, **hyper, "params": ids})
    plan.adamw = {"state": state, "param_groups": groups}
    plan.optimizer_bytes = data + _FILE_OVERHEAD + _RECORD_OVERHEAD * (3 * len(state) + k)
    if not _zip_writer_available():  # torch.save of everything at once
        plan.transient = max(plan.transient, (data, "the whole optimizer state"))


def available_memory() -> int | None:
    """Bytes that can still be allocated without swapping: MemAvailable (free memory plus the
    page cache the kernel can reclaim), else the free pages; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_resources(plan: _Plan, out: str, optimizer_out: str | None) -> None:
    """Refuse (ConsolidateError) what would fail part-way: an allocation larger than the
    memory available, or files larger than the free space where they are written."""
    avail = available_memory()
    if avail is not None and plan.memory > avail:
        big = max(plan.scratch, plan.transient)
        raise ConsolidateError(
            f"not enough memory: consolidating needs {_size(plan.memory)} at once (the largest "
            f"allocation: {big[1]}, {_size(big[0])}), {_size(avail)} is available"
        )
    # Both files exist at once before the end (a replaced OUT frees its space only at the
    # rename), so on one filesystem their sizes add up.
    needs: dict[int, list[Any]] = {}
    outputs = [("OUT", out, plan.model_bytes)]
    if optimizer_out is not None:
        outputs.append(("--optimizer", optimizer_out, plan.optimizer_bytes))
    for flag, path, nbytes in outputs:
        d = os.path.dirname(os.path.abspath(path))
        need = needs.setdefault(os.stat(d).st_dev, [0, d, []])
        need[0] += nbytes
        need[2].append(f"{flag} {path} ({_size(nbytes)})")
    for nbytes, d, what in needs.values():
        free = shutil.disk_usage(d).free
        if nbytes > free:
            raise ConsolidateError(
                f"not enough disk space in {d}: {' + '.join(what)} need {_size(nbytes)}, "
                f"{_size(free)} is free (the largest tensor: {plan.largest[1]}, "
                f"{_size(plan.largest[0])})"
            )


# -- outputs that must not touch the checkpoint ----------------------------------------------------
def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _inside(path: str, directory: str) -> bool:
    """Whether the resolved ``path`` is ``directory`` or lies under it. realpath handles
    symlinks, ``..`` and relative paths; comparing (device, inode) of each existing ancestor
    also catches the directory reached through a bind mount."""
    if os.path.commonpath([path, directory]) == directory:
        return True
    try:
        d = os.stat(directory)
    except OSError:
        return False
    while True:
        try:
            s = os.stat(path)
            if (s.st_dev, s.st_ino) == (d.st_dev, d.st_ino):
                return True
        except OSError:
            pass  # not created yet
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def check_outputs(ckpt_dirs: Sequence[str], ckpt_path: str, out: str, opt_out: str | None) -> None:
    """Refuse (ConsolidateError) outputs that would overwrite the checkpoint, its lock file,
    or each other; each file is checked with the ``.partial`` file it is first written to."""
    outputs = [("OUT", out)] + ([("--optimizer", opt_out)] if opt_out is not None else [])
    lock = _real(lock_file(ckpt_path))
    for flag, path in outputs:
        for target in (path, path + ".partial"):
            real = _real(target)
            via = "" if target == path else f" (through its temporary file {target})"
            for d in ckpt_dirs:
                if _inside(real, _real(d)):
                    raise ConsolidateError(
                        f"{flag} {path}{via} resolves to {real}, inside the checkpoint directory "
                        f"{d}: writing it would destroy the checkpoint; write outside it"
                    )
            if real == lock:
                raise ConsolidateError(f"{flag} {path}{via} is the checkpoint's lock file")
        if os.path.isdir(path):
            raise ConsolidateError(f"{flag} {path} is a directory: give a file name")
    if opt_out is None:
        return
    if _real(out) == _real(opt_out):
        raise ConsolidateError(
            f"--optimizer {opt_out} is the same file as OUT {out}: the optimizer state would "
            f"replace the model; give two different files"
        )
    if {_real(out), _real(out + ".partial")} & {_real(opt_out), _real(opt_out + ".partial")}:
        raise ConsolidateError(
            f"OUT {out} and --optimizer {opt_out}: one is the other's temporary .partial file"
        )


# -- consolidate -------------------------------------------------------------------------------
def consolidate(
    path: str, out: str, optimizer_out: str | None = None, *, verify: bool = True
) -> dict[str, Any]:
    """Write the consolidated files; returns sizes. Raises CheckpointError for a bad
    checkpoint and ConsolidateError for outputs or sizes that cannot work, both before writing
    anything; on any failure while writing, the ``.partial`` files it made are removed."""
    # As load_checkpoint: "ck/" and "ck" name the same lock, ck.lock, not ck/.lock.
    path = os.path.normpath(os.fspath(path))
    out = os.fspath(out)
    optimizer_out = None if optimizer_out is None else os.fspath(optimizer_out)
    check_outputs([path], path, out, optimizer_out)
    with reading(path):  # a concurrent save waits: the files stay those of one checkpoint
        ck = open_checkpoint(path, verify=verify)
        if ck.dir != path:  # resolved to a sibling left by an interrupted save
            check_outputs([path, ck.dir], path, out, optimizer_out)
        src = _Source(ck)
        started: list[str] = []  # .partial files this run may have created
        try:
            plan = _plan(src, optimizer_out is not None)
            check_resources(plan, out, optimizer_out)
            started.append(out + ".partial")
            _write_model(out, src, plan)
            result = {
                "model_bytes": os.path.getsize(out),
                "tensors": len(plan.entries),
                "largest_param_bytes": max(
                    (4 * math.prod(p["shape"]) for p in ck.meta["params"].values()), default=0
                ),
            }
            if optimizer_out is not None:
                started.append(optimizer_out + ".partial")
                stream_torch_save(plan.adamw, optimizer_out)
                result["optimizer_bytes"] = os.path.getsize(optimizer_out)
        except BaseException as exc:
            for tmp in started:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass  # never created, already renamed, or removed by the writer's abort
            # ENOSPC, EIO, ... while writing: an OSError from Python's files, a RuntimeError
            # from torch's C++ zip writer (CheckpointError is one too, but is a bad checkpoint).
            if (
                started
                and isinstance(exc, (OSError, RuntimeError))
                and not isinstance(exc, (CheckpointError, ConsolidateError))
            ):
                raise ConsolidateError(
                    f"writing {started[-1].removesuffix('.partial')} failed: {_one_line(exc)}; "
                    f"its partial file was removed"
                ) from exc
            raise
        finally:
            src.close()
    return result


def _write_model(out: str, src: _Source, plan: _Plan) -> None:
    w = StreamWriter(out, plan.entries, plan.metadata)
    try:
        for (key, dt, shape), (canon, is_param) in zip(plan.entries, plan.sources):
            if is_param:
                for t in src.chunks(canon, dt):
                    w.write(key, t)
                continue
            rd = src.reader(src.ck.buffer_file[canon])
            for a, b in chunks(0, math.prod(shape), dt.itemsize):
                w.write(key, rd.read(f"buffer/{canon}", a, b).to(dt))
        w.close()
    except BaseException:
        w.abort()
        raise


def run(args) -> int:
    t0 = time.perf_counter()
    try:
        r = consolidate(args.path, args.out, args.optimizer, verify=not args.no_verify)
    except KeyboardInterrupt:
        print("consolidate: interrupted; no partial file is left", file=sys.stderr)
        return 130
    except (ConsolidateError, CheckpointError, OSError, ValueError, MemoryError) as exc:
        print(f"consolidate: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    msg = f"wrote {args.out} ({r['tensors']} tensors, {r['model_bytes'] / 1e6:.1f} MB)"
    if args.optimizer:
        msg += f" and {args.optimizer} ({r['optimizer_bytes'] / 1e6:.1f} MB)"
    print(f"{msg} in {time.perf_counter() - t0:.2f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = configure_parser(
        argparse.ArgumentParser(prog="python -m zerokern consolidate", description=DESCRIPTION)
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
