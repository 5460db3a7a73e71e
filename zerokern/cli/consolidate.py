"""``python -m zerokern consolidate PATH OUT [--optimizer OUT_OPT]``: a zerokern checkpoint (any
world size, any stage) to a plain fp32 ``state_dict`` in one safetensors file, and optionally a
``torch.optim.AdamW`` state dict (``torch.save`` format).

Memory: the model file is streamed: its header is computed from the shapes in meta.json, then
each tensor's bytes are read from the rank files with ``pread`` and written in chunks of at most
64 MiB (format.CHUNK_BYTES), so the peak is a constant, whatever the size of the model or of its
largest parameter. The optimizer file is written with torch's own zip writer, one tensor record
at a time (format.stream_torch_save): a record must be written whole, so its peak is one moment
of the largest parameter, read straight into place.

    python -m zerokern consolidate ckpt/ model.safetensors --optimizer adamw.pt

then ``model.load_state_dict(safetensors.torch.load_file("model.safetensors"))`` and
``adamw.load_state_dict(torch.load("adamw.pt"))`` with AdamW built over the same param groups as
the ZeroAdamW that saved it (for one group over ``model.parameters()``: indices follow
``model.parameters()``).
"""

from __future__ import annotations

import argparse
import io
import math
import os
import pickle
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..checkpoint.format import (
    CheckpointError,
    StreamWriter,
    chunks,
    dtype_from_name,
    read_header,
)
from ..checkpoint.load import Opened, open_checkpoint

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
        return obj.make().to("cpu", obj.dtype).reshape(obj.shape)
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


class _Source:
    """Reads parameter elements out of the rank files (pread, no memory map) into one scratch
    buffer that is reused: every tensor is written out before the next read, and one long-lived
    buffer does not fragment the heap the way a fresh allocation per chunk does."""

    def __init__(self, ck: Opened) -> None:
        self.ck, self.meta, self.readers = ck, ck.meta, {}
        self._scratch: Any = None

    def reader(self, fname: str) -> RangeReader:
        if fname not in self.readers:
            self.readers[fname] = RangeReader(os.path.join(self.ck.dir, fname))
        return self.readers[fname]

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(dtype)

    def spans(self, name: str, what: str) -> Any:
        numel = math.prod(self.meta["params"][name]["shape"])
        for rel, fname, kind, a, b in self.ck.index.spans(name, 0, numel):
            tensor = kind if kind != "state" else ("master" if what == "values" else what)
            yield rel, self.reader(fname), tensor, a, b

    def chunks(self, name: str, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """The values of ``name`` as ``dtype``, chunk after chunk (each valid until the next)."""
        for _, rd, tensor, a, b in self.spans(name, "values"):
            stored = rd.tensors[tensor].dtype
            for ca, cb in chunks(a, b, 4):
                buf = self.scratch(cb - ca, stored)
                rd.read_into(tensor, ca, buf)
                yield buf.to(dtype)

    def full(self, name: str, what: str) -> torch.Tensor:
        """exp_avg or exp_avg_sq of ``name`` (fp32), read straight into the scratch buffer."""
        shape = self.meta["params"][name]["shape"]
        out = self.scratch(math.prod(shape), torch.float32)
        for rel, rd, tensor, a, b in self.spans(name, what):
            rd.read_into(tensor, a, out.narrow(0, rel, b - a))
        return out.view(shape)

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self._scratch = None


def consolidate(
    path: str, out: str, optimizer_out: str | None = None, *, verify: bool = True
) -> dict[str, Any]:
    """Write the consolidated files; returns sizes. Raises CheckpointError for a bad
    checkpoint (before writing anything)."""
    ck = open_checkpoint(path, verify=verify)
    src = _Source(ck)
    try:
        n = _write_model(out, src)
        result = {
            "model_bytes": os.path.getsize(out),
            "tensors": n,
            "largest_param_bytes": max(
                (4 * math.prod(p["shape"]) for p in ck.meta["params"].values()), default=0
            ),
        }
        if optimizer_out is not None:
            result["optimizer_bytes"] = _write_adamw(src, optimizer_out)
    finally:
        src.close()
    return result


def _write_model(out: str, src: _Source) -> int:
    meta = src.meta
    entries, sources = [], []
    for key in meta["state_dict_keys"]:  # tied names and buffers included, as state_dict()
        canon = meta["aliases"].get(key, key)
        info = meta["params"].get(canon) or meta["buffers"].get(canon)
        if info is None:
            raise ValueError(f"meta.json: state dict key {key!r} is neither parameter nor buffer")
        dt = dtype_from_name(info["dtype"])
        entries.append((key, torch.float32 if dt.is_floating_point else dt, info["shape"]))
        sources.append((canon, canon in meta["params"]))
    # Wider elements first, so that every tensor starts aligned to its element size.
    order = sorted(range(len(entries)), key=lambda i: -entries[i][1].itemsize)
    w = StreamWriter(
        out,
        [entries[i] for i in order],
        {
            "format": "pt",
            "source": "zerokern consolidate",
            "zerokern_version": meta.get("zerokern_version", ""),
        },
    )
    try:
        for i in order:
            key, dt, shape = entries[i]
            canon, is_param = sources[i]
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
    return len(entries)


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


def _write_adamw(src: _Source, out: str) -> int:
    """{"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]} with i counting
    the parameters of the saved param groups in order, as torch's state_dict() numbers them;
    state only for parameters that took a step (torch creates it lazily, at the first one)."""
    defaults = adamw_defaults()
    meta = src.meta
    state: dict[int, Any] = {}
    groups, k = [], 0
    for g in meta["param_groups"]:
        ids = []
        for name in g["params"]:
            p = meta["params"][name]
            if p["managed"] and (p["step"] or 0) > 0:
                state[k] = {"step": torch.tensor(float(p["step"]))}
                for what in ("exp_avg", "exp_avg_sq"):
                    state[k][what] = LazyTensor(
                        p["shape"], torch.float32, lambda n=name, w=what: src.full(n, w)
                    )
            ids.append(k)
            k += 1
        hyper = {
            kk: tuple(v) if isinstance(defaults.get(kk), tuple) else v
            for kk, v in g["hyper"].items()
        }
        groups.append({**defaults, **hyper, "params": ids})
    stream_torch_save({"state": state, "param_groups": groups}, out)
    return os.path.getsize(out)


def run(args) -> int:
    t0 = time.perf_counter()
    try:
        r = consolidate(args.path, args.out, args.optimizer, verify=not args.no_verify)
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"consolidate: error: {exc}", file=sys.stderr)
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
