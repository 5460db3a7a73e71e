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
import math
import os
import sys
import time
from typing import Any

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


class _Source:
    """Reads parameter elements out of the rank files (pread, no memory map) into one scratch
    buffer that is reused: every tensor is written out before the next read, and one long-lived
    buffer does not fragment the heap the way a fresh allocation per chunk does."""

    def __init__(self, ck: Any) -> None:
        self.ck, self.meta, self.readers = ck, ck.meta, {}
        self._scratch: Any = None

    def reader(self, fname: str) -> Any:
        from ..checkpoint.format import RangeReader

        if fname not in self.readers:
            self.readers[fname] = RangeReader(os.path.join(self.ck.dir, fname))
        return self.readers[fname]

    def scratch(self, numel: int, dtype: Any) -> Any:
        import torch

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

    def chunks(self, name: str, dtype: Any) -> Any:
        """The values of ``name`` as ``dtype``, chunk after chunk (each valid until the next)."""
        from ..checkpoint.format import chunks

        for _, rd, tensor, a, b in self.spans(name, "values"):
            stored = rd.tensors[tensor].dtype
            for ca, cb in chunks(a, b, 4):
                buf = self.scratch(cb - ca, stored)
                rd.read_into(tensor, ca, buf)
                yield buf.to(dtype)

    def full(self, name: str, what: str) -> Any:
        """exp_avg or exp_avg_sq of ``name`` (fp32), read straight into the scratch buffer."""
        import torch

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
    from ..checkpoint.load import open_checkpoint

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
    import torch

    from ..checkpoint.format import StreamWriter, chunks, dtype_from_name

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
        {"format": "pt", "source": "zerokern consolidate",
         "zerokern_version": meta.get("zerokern_version", "")},
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

    import torch

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
    import torch

    from ..checkpoint.format import LazyTensor, stream_torch_save

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
    from ..checkpoint.format import CheckpointError

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
