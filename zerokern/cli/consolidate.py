"""``python -m zerokern consolidate PATH OUT [--optimizer OUT_OPT]``: a zerokern checkpoint (any
world size, any stage) to a plain fp32 ``state_dict`` in one safetensors file, and optionally a
``torch.optim.AdamW`` state dict (``torch.save`` format).

Memory: the model file is streamed: its header is computed from the shapes in meta.json, then
each tensor's bytes are read from the rank files with ``pread`` and written in chunks of at most
64 MiB (format.CHUNK_BYTES), so the peak is a constant, whatever the size of the model or of its
largest parameter. The optimizer file is written with torch's own zip writer, one tensor record
at a time (format.stream_torch_save): an AdamW state dict is a pickle of per-parameter tensors
and each record must be written whole, so its peak is one moment of the largest parameter.

    python -m zerokern consolidate ckpt/ model.safetensors --optimizer adamw.pt

then ``model.load_state_dict(safetensors.torch.load_file("model.safetensors"))`` and
``adamw.load_state_dict(torch.load("adamw.pt"))`` with AdamW built over the same param groups as
the ZeroAdamW that saved it (for one group over ``model.parameters()``: indices follow
``model.parameters()``).
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--optimizer", metavar="OUT_OPT", default=None,
                   help="also write a torch.optim.AdamW state dict (torch.save format) here")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the sha256 check of the rank files (sizes are still checked)")
    p.set_defaults(func=run)
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``consolidate`` on a dispatcher's ``add_subparsers()`` object."""
    p = subparsers.add_parser("consolidate", help=HELP, description=DESCRIPTION)
    return configure_parser(p)


def _out_dtype(name: str) -> Any:
    import torch

    from ..checkpoint.format import dtype_from_name

    dt = dtype_from_name(name)
    return torch.float32 if dt.is_floating_point else dt


def consolidate(path: str, out: str, optimizer_out: str | None = None, *,
                verify: bool = True) -> dict[str, Any]:
    """Write the consolidated files; returns sizes. Raises CheckpointError for a bad
    checkpoint (before writing anything)."""
    import math

    import torch

    from ..checkpoint.format import RangeReader, chunks
    from ..checkpoint.load import open_checkpoint

    ck = open_checkpoint(path, verify=verify)
    meta, index = ck.meta, ck.index
    readers: dict[str, RangeReader] = {}

    def reader(fname: str) -> RangeReader:
        if fname not in readers:
            readers[fname] = RangeReader(os.path.join(ck.dir, fname))
        return readers[fname]

    def stream(name: str, what: str, dtype: Any):
        """Chunks of parameter ``name``'s values/exp_avg/exp_avg_sq, in element order."""
        numel = math.prod(meta["params"][name]["shape"])
        for _, fname, kind, a, b in index.spans(name, 0, numel):
            tensor = kind if kind != "state" else ("master" if what == "values" else what)
            for ca, cb in chunks(a, b, 4):
                yield reader(fname).read(tensor, ca, cb).to(dtype)

    entries, sources = [], []
    for key in meta["state_dict_keys"]:
        canon = meta["aliases"].get(key, key)
        src = meta["params"].get(canon) or meta["buffers"].get(canon)
        if src is None:
            raise ValueError(f"meta.json: state dict key {key!r} is neither parameter nor buffer")
        dt = _out_dtype(src["dtype"])
        entries.append((key, dt, src["shape"]))
        sources.append((canon, canon in meta["params"]))
    order = sorted(range(len(entries)),
                   key=lambda i: -torch.empty(0, dtype=entries[i][1]).element_size())
    try:
        _write_model(out, meta, ck, entries, sources, order, reader, stream)
        result = {"model_bytes": os.path.getsize(out), "tensors": len(entries),
                  "largest_param_bytes": max((4 * math.prod(p["shape"])
                                              for p in meta["params"].values()), default=0)}
        if optimizer_out is not None:
            result["optimizer_bytes"] = _write_adamw(meta, stream, optimizer_out)
    finally:
        for r in readers.values():
            r.close()
    return result


def _write_model(out, meta, ck, entries, sources, order, reader, stream) -> None:
    import math

    import torch

    from ..checkpoint.format import StreamWriter, chunks

    w = StreamWriter(out, [entries[i] for i in order],
                     {"format": "pt", "source": "zerokern consolidate",
                      "zerokern_version": meta.get("zerokern_version", "")})
    try:
        for i in order:
            key, dt, shape = entries[i]
            canon, is_param = sources[i]
            if is_param:
                for t in stream(canon, "values", dt):
                    w.write(key, t)
            else:
                rd = reader(ck.buffer_file[canon])
                esz = torch.empty(0, dtype=dt).element_size()
                for a, b in chunks(0, math.prod(shape), esz):
                    w.write(key, rd.read(f"buffer/{canon}", a, b).to(dt))
        w.close()
    except BaseException:
        w.abort()
        raise


def _write_adamw(meta: dict[str, Any], stream: Any, out: str) -> int:
    import math

    import torch

    from ..checkpoint.format import LazyTensor, stream_torch_save

    # AdamW's own defaults for the keys ZeroAdamW does not have (amsgrad, foreach, ...).
    defaults = {k: v for k, v in torch.optim.AdamW([torch.zeros(1)]).param_groups[0].items()
                if k != "params"}

    def assemble(name: str, what: str) -> Any:
        def make() -> torch.Tensor:
            shape = meta["params"][name]["shape"]
            full = torch.empty(math.prod(shape), dtype=torch.float32)
            pos = 0
            for t in stream(name, what, torch.float32):
                full[pos:pos + t.numel()] = t
                pos += t.numel()
            return full.view(shape)
        return LazyTensor(meta["params"][name]["shape"], torch.float32, make)

    state: dict[int, Any] = {}
    groups, k = [], 0
    for g in meta["param_groups"]:
        ids = []
        for name in g["params"]:
            p = meta["params"][name]
            if p["managed"] and (p["step"] or 0) > 0:
                state[k] = {"step": torch.tensor(float(p["step"])),
                            "exp_avg": assemble(name, "exp_avg"),
                            "exp_avg_sq": assemble(name, "exp_avg_sq")}
            ids.append(k)
            k += 1
        hyper = {kk: tuple(v) if isinstance(defaults.get(kk), tuple) else v
                 for kk, v in g["hyper"].items()}
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
    parser = configure_parser(argparse.ArgumentParser(prog="python -m zerokern consolidate",
                                                      description=DESCRIPTION))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
