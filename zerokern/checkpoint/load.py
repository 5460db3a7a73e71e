"""load_checkpoint: restore a model and its ZeroAdamW from a checkpoint saved at any world size
and stage, each rank reading only the byte ranges it needs.

Three phases, each ended by an all_gather of errors so that every rank raises together:

1. open (no writes): find the directory (resolve), read meta.json and check all of it
   (validate.check_meta: every key and value, the piece tables, the meta_sha256 digest), check
   that every rank file is a regular file (no symbolic link) with the recorded size and a
   header that matches meta.json (validate.check_rank_file), and (``verify=True``) its sha256;
   rank r hashes files r, r+N, ... so the checkpoint is read once in all, not N times (on a
   2-D mesh r and N count every rank of the mesh, replica by replica);
2. match (no writes): the model's parameter and buffer names and shapes against meta.json,
   optimizer parameters against saved optimizer state, param groups against saved groups;
3. apply: lay out the optimizer (``_ensure_layout``, with the saved gradient order when the
   stage is 0-2), then for each piece of this rank's new layout read the overlapping ranges of
   the saved pieces (``safe_open(...).get_slice(t)[a:b]``, memory-mapped) straight into
   the master and the optimizer's buffers; 16-bit parameters are the round-to-nearest-even
   cast of the fp32 master (which is how ZeroAdamW makes them), so they are not stored. Stages
   0-2 need full parameters on every rank: each parameter is read piece by piece from the
   masters of all saved ranks and cast into ``flat_param``; stage 3 needs only this rank's
   slice. A compressed state (moments.py) is read into the state as this optimizer stores it:
   int8 codes and absmax copied exactly when both store int8 (the blocks are the parameter's
   own, so any new layout's pieces are made of saved ones), otherwise through fp32
   (dequantize, then quantize or round); the values of ``master="none"`` are the bf16
   parameters, and its seed comes back with them.

Phases 1-2 catch every problem of the checkpoint itself before anything is modified; only an
I/O error in phase 3 (the files changing under the reader) can leave a partial load, and it is
reported as such.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from ..quant.maps import decodes_alike
from ..zero.interop import optimizer_of
from ..zero.registry import runtime_of_module
from ..zero.shards import ShardRange
from ..zero.state_format import StateFormat
from . import arrival
from .format import (
    META,
    CheckpointError,
    PieceIndex,
    chunks,
    open_regular,
    read_header,
    sha256_file,
    siblings,
)
from .locks import reading
from .moments import (
    STATE_FORMAT,
    MomentIndex,
    copy_int8_into,
    has_table,
    read_fp32_into,
)
from .optimizer_entry import apply_scalars, match_rule
from .residuals import load_residuals
from .save import ModelNames, Team, agree, attempt, model_names, stage3_runtime
from .validate import check_meta, check_rank_file


# -- meta.json and the files it names ----------------------------------------------------------
def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: a repeated key would otherwise keep its last value silently."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} appears twice in one object")
        out[k] = v
    return out


def read_meta(ckpt: str) -> dict[str, Any]:
    """meta.json parsed (checked by validate.check_meta, not here)."""
    path = os.path.join(ckpt, META)
    if not os.path.lexists(path):
        raise CheckpointError(
            f"{ckpt}: {META} is missing: the checkpoint is incomplete (a save did not finish; "
            f"{META} is written last) or this is not a zerokern checkpoint"
        )
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            return json.load(f, object_pairs_hook=_no_duplicate_keys)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise CheckpointError(f"{META} is corrupt ({path}): {exc}") from None


FileId = tuple[int, int]  # (st_dev, st_ino): the file checked is the file read


def check_files(
    ckpt: str, meta: dict[str, Any], *, checksum: Callable[[int], bool]
) -> dict[str, FileId]:
    """Every file meta.json (already checked) names is a regular file in ``ckpt`` with the
    recorded size and a header that matches, and its sha256 matches for the files
    ``checksum(index)`` selects."""
    ids: dict[str, FileId] = {}
    for i, f in enumerate(meta["files"]):
        path = os.path.join(ckpt, f["name"])
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"{f['name']} is missing from {ckpt} ({META} lists it): the "
                f"checkpoint is incomplete"
            ) from None
        if not stat.S_ISREG(st.st_mode):  # lstat: a symbolic link is not followed
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise CheckpointError(
                f"{f['name']} is {what} ({path}): the files of a checkpoint must be regular "
                f"files inside its directory"
            )
        if st.st_size != f["bytes"]:
            raise CheckpointError(
                f"{f['name']} is truncated or modified ({path}): {st.st_size} bytes, "
                f"{META} records {f['bytes']}"
            )
        tensors, header_meta = read_header(path)
        check_rank_file(meta, i, tensors, header_meta, path)
        if checksum(i) and sha256_file(path) != f["sha256"]:
            raise CheckpointError(
                f"{f['name']} is corrupt ({path}): its sha256 does not match "
                f"the one recorded in {META}"
            )
        ids[f["name"]] = (st.st_dev, st.st_ino)
    return ids


def resolve(path: str) -> str:
    """The directory to load for ``path``: itself, or after a save that crashed between its
    two renames (filesystems without RENAME_EXCHANGE), the newest complete sibling."""
    if os.path.isdir(path) or os.path.lexists(path):
        return path
    found = []
    for d in siblings(path):
        try:
            meta = _open(d, checksum=lambda i: False).meta
        except (CheckpointError, OSError):
            continue
        found.append((meta["created_ns"], d))
    if not found:
        raise CheckpointError(f"no checkpoint at {path}")
    return max(found)[1]


@dataclass
class Opened:
    dir: str
    meta: dict[str, Any]
    index: PieceIndex
    buffer_file: dict[str, str]
    file_ids: dict[str, FileId] = field(default_factory=dict)


def _open(d: str, *, checksum: Callable[[int], bool]) -> Opened:
    meta = read_meta(d)
    try:
        index = check_meta(meta, d)
        ids = check_files(d, meta, checksum=checksum)
    except (KeyError, TypeError, ValueError) as exc:  # a check missed: still refused up front
        raise CheckpointError(f"{META} in {d} is malformed ({exc!r})") from None
    buffer_file = {b: f["name"] for f in meta["files"] for b in f["buffers"]}
    return Opened(d, meta, index, buffer_file, ids)


def open_checkpoint(path: str, *, rank: int = 0, world: int = 1, verify: bool = True) -> Opened:
    """meta.json plus every check that needs no model; sha256 of files index % world == rank.
    The meta_sha256 digest of meta.json is checked even without ``verify`` (it is cheap)."""
    return _open(resolve(path), checksum=lambda i: verify and i % world == rank)


@dataclass
class Match:
    names: ModelNames
    managed: dict[int, int]  # id(param) -> optimizer index
    groups: list[int | None]  # optimizer group -> saved group its hyperparameters come from
    order: list[int] | None  # saved gradient order, as this optimizer's indices


def _names_list(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:5]) + (
        f" and {len(names) - 5} more" if len(names) > 5 else ""
    )


def match(ck: Opened, model: torch.nn.Module, opt: Any) -> Match:
    meta, rt = ck.meta, _runtime(model, opt)
    names = model_names(model)
    saved = meta["params"]
    missing = [n for n in names.params if n not in saved]
    unexpected = [n for n in saved if n not in names.params]
    if missing or unexpected:
        raise CheckpointError(
            f"{ck.dir} does not fit the model: "
            + (f"missing parameters {_names_list(missing)}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected parameters {_names_list(unexpected)}" if unexpected else "")
        )
    for n, p in names.params.items():
        shape = list(rt.shape_of(p) if rt is not None else p.shape)
        if shape != saved[n]["shape"]:
            raise CheckpointError(
                f"{ck.dir}: parameter {n!r} has shape {saved[n]['shape']} in "
                f"the checkpoint, {shape} in the model"
            )
    bmiss = [n for n in names.buffers if n not in meta["buffers"]]
    bextra = [n for n in meta["buffers"] if n not in names.buffers]
    if bmiss or bextra:
        raise CheckpointError(
            f"{ck.dir} does not fit the model's buffers: missing "
            f"{_names_list(bmiss) or 'none'}, unexpected "
            f"{_names_list(bextra) or 'none'}"
        )
    for n, b in names.buffers.items():
        if list(b.shape) != meta["buffers"][n]["shape"]:
            raise CheckpointError(
                f"{ck.dir}: buffer {n!r} has shape "
                f"{meta['buffers'][n]['shape']} in the checkpoint, "
                f"{list(b.shape)} in the model"
            )
    if opt is None:  # weights only: no optimizer state to place
        return Match(names, {}, [], None)
    managed = {id(p): i for i, p in enumerate(opt.managed_params)}
    for p in opt.managed_params:
        n = names.param.get(id(p))
        if n is None:
            raise ValueError("the optimizer manages a parameter that is not in the model")
        if not saved[n]["managed"]:  # (an empty parameter has no pieces, hence no kind)
            raise CheckpointError(
                f"{ck.dir}: {n!r} was not trained when saved (no optimizer "
                f"state), but this optimizer trains it"
            )
    groups: list[int | None] = []
    for g, grp in enumerate(opt.param_groups):
        src = {saved[names.param[id(p)]]["group"] for p in grp["params"] if id(p) in managed}
        if len(src) > 1:
            raise CheckpointError(
                f"param group {g} mixes parameters of saved param groups "
                f"{sorted(src)}; build the groups as when saving"
            )
        groups.append(src.pop() if src else None)
    match_rule(ck.dir, meta, opt, groups)  # the same update rule, hyperparameters it takes
    order = None
    if rt is None and opt.layout is None and meta.get("ready_order"):
        order = [
            managed[id(names.params[n])]
            for n in meta["ready_order"]
            if n in names.params and id(names.params[n]) in managed
        ]
    return Match(names, managed, groups, order)


class _Reader:
    """Memory-mapped safetensors handles, opened on first use and closed with the stack."""

    def __init__(self, ck: Opened, stack: ExitStack) -> None:
        from safetensors import safe_open

        self.ck, self.stack, self.open = ck, stack, safe_open
        self.handles: dict[str, Any] = {}
        # The moments tables of a compressed checkpoint (None: moments in the state triple).
        self.moments = MomentIndex(ck.meta, ck.dir) if has_table(ck.meta) else None

    def handle(self, fname: str) -> Any:
        h = self.handles.get(fname)
        if h is None:
            path = os.path.join(self.ck.dir, fname)
            # safe_open takes a path (and follows links): is it still the file checked?
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) != self.ck.file_ids.get(fname, (st.st_dev, st.st_ino)):
                raise CheckpointError(f"{fname} was replaced ({path}) while being loaded")
            h = self.handles[fname] = self.stack.enter_context(self.open(path, framework="pt"))
        return h

    def read_into(self, dst: torch.Tensor, name: str, lo: int, what: str) -> None:
        """dst (1-D) <- elements [lo, lo + len(dst)) of ``name``'s values (fp32 master, the
        bf16 parameters of master="none", or the stored frozen values), or of a buffer of the
        optimizer kept in the state triple; cast to dst's dtype (round to nearest even for
        16-bit)."""
        for rel, fname, kind, a, b in self.ck.index.spans(name, lo, lo + dst.numel()):
            tensor = kind if kind != "state" else ("master" if what == "values" else what)
            sl = self.handle(fname).get_slice(tensor)
            for ca, cb in chunks(a, b, 4):
                dst.narrow(0, rel + ca - a, cb - ca).copy_(sl[ca:cb])

    def raw(self, fname: str, tensor: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of a rank file's tensor, as stored (moments.RawReader)."""
        return self.handle(fname).get_slice(tensor)[a:b]

    def read_moment(self, dst: torch.Tensor, name: str, lo: int, key: str) -> None:
        """dst <- moment ``key`` of elements [lo, lo + len(dst)) of ``name`` as fp32 values
        (dequantized, widened) cast to dst's dtype."""
        if self.moments is None:
            self.read_into(dst, name, lo, key)
        else:
            read_fp32_into(self.moments, self.raw, name, lo, dst, key)

    def read_stored(self, r: ShardRange, name: str) -> None:
        """A range of a compressed state, into its buffers as stored: exact where the
        checkpoint stores the same format (int8: codes and absmax), through fp32 elsewhere."""
        st = r.stored
        assert st is not None
        self.read_into(st.values, name, r.start, "values")
        idx = self.moments
        for key, buf in st.state.items():
            if not buf.blockwise:  # fp32 or bf16: a cast of the fp32 values stores them
                self.read_moment(buf.data, name, r.start, key)
            elif idx is not None and idx.format_of(name) == buf.fmt and \
                    decodes_alike(idx.maps.get(key), buf.map_id):
                assert buf.absmax is not None
                copy_int8_into(idx, self.raw, name, r.start, buf.data, buf.absmax, key)
            else:  # another format saved: dequantized or widened, then quantized
                tmp = torch.empty(r.numel, dtype=torch.float32)
                self.read_moment(tmp, name, r.start, key)
                buf.write(tmp)


class _OneRank:
    """The comm of a load that involves this process only."""

    rank, world_size = 0, 1

    @staticmethod
    def all_gather_object(obj: Any, what: str, timeout: float | None = None) -> list[Any]:
        return [obj]


_ONE_RANK = _OneRank()


def _runtime(model: torch.nn.Module, opt: Any) -> Any:
    # Without an optimizer the model's own stage-3 runtime, if shard_model partitioned it.
    return runtime_of_module(model) if opt is None else stage3_runtime(model, opt)


def _apply_weights(ck: Opened, m: Match, model: torch.nn.Module) -> None:
    """The parameters (trained ones from their fp32 master, rounded to the parameter's dtype)
    and buffers, with no optimizer: what evaluation from a checkpoint needs."""
    rt = runtime_of_module(model)
    with ExitStack() as stack, torch.no_grad():
        rd = _Reader(ck, stack)
        if rt is not None:  # each rank reads the slices it holds
            for p, po, _, view in rt.local_pieces():
                rd.read_into(view, m.names.param[id(p)], po, "values")
        else:
            for n, p in m.names.params.items():
                _read_param(rd, n, p)
        for n, b in m.names.buffers.items():
            b.copy_(rd.handle(ck.buffer_file[n]).get_tensor(f"buffer/{n}"))


def apply(ck: Opened, m: Match, model: torch.nn.Module, opt: Any) -> None:
    if opt is None:
        _apply_weights(ck, m, model)
        return
    meta = ck.meta
    rt = stage3_runtime(model, opt)
    with ExitStack() as stack, torch.no_grad():
        rd = _Reader(ck, stack)
        # No collective inside (gather=False): a rank that fails here must not leave the
        # others waiting; every rank reads the full parameters it holds itself.
        with opt.edit_shards(gather=False, ready_order=m.order) as shards:
            for sh in shards:
                n = m.names.param[id(sh.param)]
                for r in sh.ranges:
                    if r.stored is not None:  # a compressed state, written as stored
                        rd.read_stored(r, n)
                        continue
                    rd.read_into(r.values, n, r.start, "values")
                    for key in r.keys[1:]:  # the rule's buffers, in the state triple
                        rd.read_moment(getattr(r, key), n, r.start, key)
                sh.step = meta["params"][n]["step"]  # an int >= 0 (check_meta)
            if rt is not None:  # stage 3: frozen parameters are sharded like the rest
                for p, po, _, view in rt.local_pieces():
                    if id(p) not in m.managed:
                        rd.read_into(view, m.names.param[id(p)], po, "values")
            else:
                for n, p in m.names.params.items():
                    # Stages 1-2 hold every parameter in full on every rank; frozen ones are
                    # not the optimizer's at all.
                    if id(p) not in m.managed or opt.stage in (1, 2):
                        _read_param(rd, n, p)
        for n, b in m.names.buffers.items():
            b.copy_(rd.handle(ck.buffer_file[n]).get_tensor(f"buffer/{n}"))
    apply_scalars(meta, opt, m.names.param)
    sf = meta.get(STATE_FORMAT)
    if StateFormat.saved_in_place(sf) and opt.state_format.in_place:
        opt.seed = sf["seed"]  # the stochastic rounding goes on as it would have
    for grp, src in zip(opt.param_groups, m.groups):
        if src is None:
            continue
        for k, v in meta["param_groups"][src]["hyper"].items():
            grp[k] = tuple(v) if isinstance(grp.get(k), tuple) and isinstance(v, list) else v
    if meta.get("scaler") is not None:
        if opt.scaler is not None:
            opt.scaler.load_state_dict(meta["scaler"])
        else:
            warnings.warn(
                "the checkpoint has loss-scaler state but this optimizer has no "
                "loss_scale; it is ignored",
                stacklevel=3,
            )


def _read_param(rd: _Reader, name: str, p: torch.Tensor) -> None:
    if p.is_contiguous():
        rd.read_into(p.detach().view(-1), name, 0, "values")
    else:
        tmp = torch.empty(p.numel(), dtype=p.dtype, device=p.device)
        rd.read_into(tmp, name, 0, "values")
        p.detach().copy_(tmp.view(p.shape))


def load_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: Any, *, verify: bool = True
) -> Any:
    """Restore ``model`` and its ``ZeroAdamW`` from ``path`` (call on every rank) and return
    the ``extra`` given to save_checkpoint. The world size, the stage and the parameter dtype
    may differ from the run that saved it; parameter names and shapes must match.
    ``optimizer=None`` loads the weights and buffers only (evaluation): trained parameters
    take their fp32 master, rounded to the parameter's dtype; a shard_model'ed model reads
    the slices each rank holds (a collective), a plain model is read by this process alone.
    Refused for a model a ZeroAdamW trains (its master would undo the load).

    Raises CheckpointError, naming the file, for a missing, incomplete, truncated or corrupt
    checkpoint (sha256 checks unless ``verify=False``; sizes and headers are always checked),
    before anything is modified. For stages 0-2, call it before the first step() or after
    (the layout is fixed here, in the saved gradient order, if it is not yet).

    With an optimizer or a sharded model it is a collective: a rank that calls it alone raises
    CollectiveTimeout naming it after ``$ZEROKERN_GATHER_TIMEOUT`` seconds (default 300 on
    gloo; on NCCL only when set), instead of waiting for the process group's timeout."""
    opt = optimizer
    rt = runtime_of_module(model) if opt is None else None
    if opt is None:
        trained = [n for n, p in model.named_parameters() if optimizer_of(p) is not None]
        if trained:
            # Its fp32 master (and, offloaded, its host copy) would overwrite the loaded
            # weights at the next step(): load through the optimizer instead.
            raise ValueError(
                f"load_checkpoint(optimizer=None): the model's parameters (e.g. "
                f"{trained[0]!r}) are trained by a ZeroAdamW; pass it as the optimizer")
    # A plain model needs no other rank (each reads the full parameters): this also works on
    # one rank alone (evaluation under `if rank == 0`). A sharded one reads its slices.
    comm = opt.comm if opt is not None else rt.comm if rt is not None else _ONE_RANK
    # On a 2-D mesh every replica reads its shard rank's ranges (the same for every replica,
    # so all end with the same state), the files are hashed once over the whole mesh, and
    # every agreement spans the mesh: an error on any replica is raised on all of them.
    team = Team(comm)
    path = os.path.normpath(os.fspath(path))
    what = f"load_checkpoint({path})"
    wait = arrival.limit(team)
    # Shared with other loads, exclusive of a save publishing at this path: the files read
    # are those of one checkpoint from meta.json to the last byte.
    with reading(path):
        msg, exc, ck = attempt(
            lambda: open_checkpoint(path, rank=team.rank, world=team.world_size, verify=verify)
        )
        # Bounded (arrival.py): the first collective, where a rank calling this alone (under
        # `if rank == 0:`) waits, and is told instead of waiting in silence.
        agree(team, what, msg, exc, wait=wait, call="load_checkpoint", path=path)
        msg, exc, m = attempt(lambda: match(ck, model, opt))
        agree(team, what, msg, exc)
        msg, exc, _ = attempt(lambda: apply(ck, m, model, opt))
        agree(team, what + " failed part-way; the model and optimizer are partially loaded",
              msg, exc)
        if opt is not None:  # error feedback's residuals, where they apply (residuals.py)
            msg, exc, _ = attempt(lambda: load_residuals(ck.dir, ck.meta, opt, team))
            agree(team, what + ": the error-feedback residuals", msg, exc)
    return ck.meta.get("extra")
