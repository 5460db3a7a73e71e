"""save_checkpoint: every rank writes what it owns; rank 0 writes meta.json last and publishes.

Sequence (the same on every rank, errors gathered with all_gather_object after each step so
that a failure on one rank makes every rank raise instead of hanging in the next collective):

1. plan (no I/O): the pieces this rank owns, by parameter name; rank 0 creates
   ``PATH.tmp-<nonce>`` and shares the nonce;
2. each rank streams ``rankNNNNN.safetensors`` into it (``.partial``, fsync, rename), hashing on
   the way; the piece tables, sizes and sha256 go to rank 0;
3. rank 0 checks it can see every file with its size (the directory must be on a filesystem
   all ranks share), writes meta.json (fsync, rename), fsyncs the directory and publishes it at
   PATH (format.publish), then removes leftovers of earlier interrupted saves; if any step
   failed anywhere it removes the staging directory instead;
4. every rank learns the outcome of 3 and returns (or raises the first error) only then: no
   rank leaves before the checkpoint is published or a failed save's directory is gone.

On a 2-D mesh (hybrid sharding) ``opt.comm`` is the shard group and every replica holds the
same shards: only replica 0 writes (one file per shard rank; "rank 0" above is replica 0's
shard rank 0), the other replicas plan, take part in every agreement and return when the
checkpoint is published, like the writers. The agreements span the whole mesh (``Team``), so
an error on any rank of any replica is raised on every rank. The saved layout is the shard
group's (``world_size`` = S); meta.json records the mesh shape for information only.

A crash before step 3's publish leaves PATH untouched (the previous checkpoint, if any); the
incomplete ``PATH.tmp-*`` directory has no meta.json and is deleted by the next save.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm import CollectiveTimeout
from ..zero.registry import runtime_of_module, runtime_of_param
from ..zero.shards import ShardRange
from ..zero.stored import stored_type
from . import arrival
from .format import (
    CHUNK_BYTES,
    FORMAT,
    FORMAT_VERSION,
    META,
    META_DIGEST,
    CheckpointError,
    PieceIndex,
    StreamWriter,
    atomic_write_bytes,
    dtype_name,
    fsync_dir,
    meta_digest,
    publish,
    rank_file,
    remove_checkpoint_dir,
    siblings,
    tmp_dir,
)
from .locks import OWNER, StagingClaim, abandoned, publishing
from .moments import (
    MOMENTS,
    MOMENTS_TABLE,
    STATE_FORMAT,
    format_entry,
    values_dtype,
)
from .optimizer_entry import OPTIMIZER, known_hyper, optimizer_entry
from .residuals import RESIDUALS, residual_entry, write_residuals
from .validate import HYPER_KEYS


# -- names ------------------------------------------------------------------------------------
@dataclass
class ModelNames:
    param: dict[int, str]  # id(param) -> canonical name (first in named_parameters())
    params: dict[str, torch.nn.Parameter]
    aliases: dict[str, str]  # tied parameter names -> canonical name
    buffers: dict[str, torch.Tensor]  # persistent buffers, canonical names
    state_dict_keys: list[str] = field(default_factory=list)


def model_names(model: torch.nn.Module) -> ModelNames:
    """Names as ``model.state_dict()`` has them, found without calling it (a state_dict hook
    could run collectives)."""
    params = dict(model.named_parameters())
    pid = {id(p): n for n, p in params.items()}
    aliases: dict[str, str] = {}
    buffers: dict[str, torch.Tensor] = {}
    bid: dict[int, str] = {}
    keys: list[str] = []
    for mname, m in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for n, p in m._parameters.items():
            if p is not None:
                keys.append(prefix + n)
                if pid.get(id(p), prefix + n) != prefix + n:
                    aliases[prefix + n] = pid[id(p)]
        for n, b in m._buffers.items():
            if b is None or n in m._non_persistent_buffers_set:
                continue
            keys.append(prefix + n)
            if id(b) in bid:
                aliases[prefix + n] = bid[id(b)]
            else:
                bid[id(b)] = prefix + n
                buffers[prefix + n] = b
    return ModelNames(pid, params, aliases, buffers, keys)


def stage3_runtime(model: torch.nn.Module, opt: Any) -> Any:
    """The shard_model runtime of a stage-3 optimizer, checked to be ``model``'s (None for
    stages 0-2)."""
    if opt.stage != 3:
        return None
    rt, own = runtime_of_param(opt.managed_params[0]), runtime_of_module(model)
    # Several dtypes: the parameters' runtime is one of the model's (one per dtype).
    if own is None or rt not in own.siblings:
        raise ValueError(
            "model: the optimizer is stage 3 but this model is not the one it "
            "was built on (pass the shard_model'ed model)"
        )
    return own


def _known_group_key(group: int, key: str, opt: Any = None) -> bool:
    """Only the param-group keys a load accepts are saved: refuse others now rather than
    write a checkpoint that can never be loaded."""
    if key not in HYPER_KEYS and not known_hyper(opt, key):
        raise ValueError(
            f"param group {group} has the key {key!r}, which a checkpoint does not hold "
            f"(known: {', '.join(sorted(HYPER_KEYS))}); keep such values in "
            "save_checkpoint(..., extra=...)")
    return True


def _jsonable(key: str, v: Any) -> Any:
    if torch.is_tensor(v):
        if v.numel() != 1:
            raise TypeError(f"param group entry {key!r} is a tensor of {v.numel()} elements")
        return v.item()
    if isinstance(v, tuple):
        return [_jsonable(key, x) for x in v]
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        raise TypeError(
            f"param group entry {key!r} ({type(v).__name__}) cannot be written to {META}"
        ) from None
    return v


def mesh_entry(comm: Any) -> dict[str, Any]:
    """meta.json's ``mesh`` entry on a 2-D mesh (nothing on a flat group): its shape (R, S) and
    dim names. For information only: a load lays out from the files and pieces, at any mesh."""
    rep = getattr(comm, "replicate", None)
    if rep is None:
        return {}
    names = getattr(comm, "mesh_dim_names", None)
    return {"mesh": {"shape": [rep.world_size, comm.world_size],
                     "dim_names": None if names is None else [str(n) for n in names]}}


# -- what this rank writes ----------------------------------------------------------------------
@dataclass
class Plan:
    state: list[tuple[str, ShardRange]]  # (name, this rank's range of it)
    frozen: dict[torch.dtype, list[tuple[str, int, int, torch.Tensor]]]  # name, offset, n, src
    buffers: dict[str, torch.Tensor]
    meta: dict[str, Any]


def _unwritable(x: Any, path: str, seen: frozenset[int] = frozenset()) -> tuple[str, Any] | None:
    """The path (``extra['best_val_loss']``) and value of the first entry of ``x`` that json
    cannot write, so that the error names it; None if ``x`` is no dict or list holding one.
    An entry that leads back to an enclosing one (a cycle, which json's message names) is
    passed over."""
    if not isinstance(x, (dict, list, tuple)):
        return None
    seen = seen | {id(x)}
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if id(v) in seen:
            continue
        try:
            json.dumps(v)
        except (TypeError, ValueError, RecursionError):
            return _unwritable(v, f"{path}[{k!r}]", seen) or (f"{path}[{k!r}]", v)
    return None


def plan_save(model: torch.nn.Module, opt: Any, extra: Any) -> Plan:
    rank, world = opt.comm.rank, opt.comm.world_size
    rt = stage3_runtime(model, opt)
    names = model_names(model)
    managed = {id(p): i for i, p in enumerate(opt.managed_params)}
    for i, p in enumerate(opt.managed_params):
        if id(p) not in names.param:
            raise ValueError(f"optimizer parameter {i} is not a parameter of the model")
    try:
        extra_json = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as exc:
        found = _unwritable(extra, "extra")
        where = f" ({found[0]} is a {type(found[1]).__name__})" if found else ""
        if found and isinstance(found[1], torch.Tensor) and found[1].dim() == 0:
            where += f"; for a 0-d tensor such as nanoGPT's best_val_loss pass float({found[0]})"
        raise TypeError(f"extra must be JSON-serialisable: {exc}{where}") from None
    shards = opt.shards()
    ranges = [(names.param[id(sh.param)], r) for sh in shards for r in sh.ranges]
    if opt.stage == 0 and world > 1:  # replicated state: each rank writes 1/N of it
        total, acc, mine = sum(r.numel for _, r in ranges), 0, []
        lo, hi = rank * total // world, (rank + 1) * total // world
        for row in ranges:
            if lo <= acc < hi:
                mine.append(row)
            acc += row[1].numel
        ranges = mine
    frozen: dict[torch.dtype, list] = {}
    if rt is not None:  # stage 3: frozen parameters are sharded in the units like the rest
        for p, po, k, view in rt.local_pieces():
            if id(p) not in managed:
                frozen.setdefault(p.dtype, []).append((names.param[id(p)], po, k, view))
    elif rank == 0:
        for n, p in names.params.items():
            if id(p) not in managed:
                frozen.setdefault(p.dtype, []).append((n, 0, p.numel(), p.detach().reshape(-1)))
    group_of = {id(p): g for g, grp in enumerate(opt.param_groups) for p in grp["params"]}
    params = {}
    for n, p in names.params.items():
        i = managed.get(id(p))
        shape = rt.shape_of(p) if rt is not None else p.shape
        params[n] = {
            "shape": list(shape),
            "dtype": dtype_name(p.dtype),
            "managed": i is not None,
            "group": group_of.get(id(p)),
            "step": None if i is None else shards[i].step,
        }
    groups = []
    for g, grp in enumerate(opt.param_groups):
        missing = [k for k, p in enumerate(grp["params"]) if id(p) not in names.param]
        if missing:
            raise ValueError(f"param group {g}: parameter {missing[0]} is not in the model")
        groups.append(
            {
                "hyper": {k: _jsonable(k, v) for k, v in grp.items()
                          # "master": a group's construction option (several dtypes)
                          if k not in ("params", "master") and _known_group_key(g, k, opt)},
                "params": [names.param[id(p)] for p in grp["params"]],
            }
        )
    from .. import __version__

    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "zerokern_version": __version__,
        "torch_version": torch.__version__,
        "created_ns": time.time_ns(),
        "world_size": world,
        **mesh_entry(opt.comm),
        "stage": opt.stage,
        "param_dtype": dtype_name(opt.dtype),
        "params": params,
        "aliases": names.aliases,
        "state_dict_keys": names.state_dict_keys,
        "buffers": {
            n: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)}
            for n, b in names.buffers.items()
        },
        "param_groups": groups,
        "ready_order": [names.param[id(opt.managed_params[i])]
                        for i in opt.layout.ready_order] or None,
        "scaler": None if opt.scaler is None else opt.scaler.state_dict(),
        "extra": extra_json,
    }
    entry = optimizer_entry(opt, names.param)
    if entry is not None:  # another rule than AdamW's: its buffers and scalars
        meta[OPTIMIZER] = entry
    fmt = opt.state_format
    sf = format_entry(fmt.moments, fmt.master, opt.seed, fmt.int8_format)
    if sf is not None:  # a compressed state: stored as the optimizer stores it (moments.py)
        meta[STATE_FORMAT] = sf
    return Plan(ranges, frozen, names.buffers if rank == 0 else {}, meta)


def write_rank_file(path: str, rank: int, opt: Any, plan: Plan, nonce: str) -> dict[str, Any]:
    n = sum(r.numel for _, r in plan.state)
    jobs: list[tuple[tuple[str, torch.dtype, list[int]], Callable[[StreamWriter], None]]] = []
    table: list[list[Any]] = []
    off = 0
    for name, r in plan.state:
        table.append([name, r.start, r.numel, "state", off])
        off += r.numel

    def state_job(key: str, field_: str) -> Callable[[StreamWriter], None]:
        def run(w: StreamWriter) -> None:
            for _, r in plan.state:
                _write_range(w, key, getattr(r, field_), 0, r.numel)

        return run

    moment_rows: list[list[Any]] | None = None
    if STATE_FORMAT not in plan.meta:
        for key, field_ in (("master", "values"), *((k, k) for k in opt.rule.state_names)):
            jobs.append(((key, torch.float32, [n]), state_job(key, field_)))
    else:
        moment_rows = _compressed_jobs(jobs, plan, n)
    for dt, rows in plan.frozen.items():
        key, off = f"frozen.{dtype_name(dt)}", 0
        for name, po, k, _ in rows:
            table.append([name, po, k, key, off])
            off += k

        def frozen_job(w: StreamWriter, key: str = key, rows: list = rows) -> None:
            for _, _, k, src in rows:
                _write_range(w, key, src, 0, k)

        jobs.append(((key, dt, [off]), frozen_job))
    for name, b in plan.buffers.items():
        jobs.append(
            (
                (f"buffer/{name}", b.dtype, list(b.shape)),
                lambda w, key=f"buffer/{name}", b=b: w.write(key, b),
            )
        )
    # Wider elements first, so every tensor starts aligned to its element size.
    jobs.sort(key=lambda j: -torch.empty(0, dtype=j[0][1]).element_size())
    name = rank_file(rank)
    w = StreamWriter(
        os.path.join(path, name),
        [j[0] for j in jobs],
        {"format": FORMAT, "rank": str(rank), "save_id": nonce},
    )
    try:
        with torch.no_grad():
            for _, job in jobs:
                job(w)
        size, sha = w.close()
    except Exception:  # a kill leaves the .partial file, like a real crash
        w.abort()
        raise
    info = {
        "name": name,
        "rank": rank,
        "bytes": size,
        "sha256": sha,
        "pieces": table,
        "buffers": list(plan.buffers),
    }
    if moment_rows is not None:
        info[MOMENTS_TABLE] = moment_rows
    return info


def _compressed_jobs(jobs: list, plan: Plan, n: int) -> list[list[Any]] | None:
    """The jobs writing a compressed state as stored (moments.py): the values (fp32 master,
    or the bf16 parameters for master="none"), then the moments: in the state triple when
    they are fp32, else per format (codes and absmax for int8); returns the moments table
    (None: no table, the moments are in the triple)."""
    def job(key: str, src: Callable[[ShardRange], torch.Tensor | None],
            ranges: list[ShardRange]) -> Callable[[StreamWriter], None]:
        def run(w: StreamWriter) -> None:
            for r in ranges:
                t = src(r)
                assert t is not None
                _write_range(w, key, t, 0, t.numel())

        return run

    ranges = [r for _, r in plan.state]
    jobs.append((("master", values_dtype(plan.meta), [n]),
                 job("master", lambda r: r.stored.values, ranges)))
    if plan.meta[STATE_FORMAT]["moments"] == "fp32":
        for key in MOMENTS:
            jobs.append(((key, torch.float32, [n]),
                         job(key, lambda r, key=key: r.stored.state[key].data, ranges)))
        return None
    # Per format, each buffer's parts as that format's stored type names them in a rank file
    # (stored.py: the data, then the block scales); a row's offset counts elements, its
    # block the scales before it.
    rows: list[list[Any]] = []
    by_fmt: dict[str, list[ShardRange]] = {}
    offset: dict[str, int] = {}
    nscales = 0
    for name, r in plan.state:
        fmt = r.stored.moments
        typ = stored_type(fmt)
        rows.append([name, r.start, r.numel, fmt, offset.get(fmt, 0),
                     nscales if typ.blockwise else 0])
        offset[fmt] = offset.get(fmt, 0) + r.numel
        nscales += typ.scale_count(r.numel)
        by_fmt.setdefault(fmt, []).append(r)
    for fmt, rs in by_fmt.items():
        typ = stored_type(fmt)
        size = {"data": offset[fmt], "absmax": nscales}
        for key in MOMENTS:
            for part, (t, dtype) in typ.file_tensors(key).items():
                jobs.append(((t, dtype, [size[part]]),
                             job(t, lambda r, key=key, part=part: r.stored.state[key].part(
                                 part), rs)))
    return rows


def _write_range(w: StreamWriter, key: str, src: torch.Tensor, start: int, numel: int) -> None:
    step = max(1, CHUNK_BYTES // src.element_size())
    for a in range(start, start + numel, step):
        w.write(key, src.narrow(0, a, min(step, start + numel - a)))


# -- the collective sequence --------------------------------------------------------------------
def attempt(fn: Callable[[], Any]) -> tuple[str | None, BaseException | None, Any]:
    """Run fn; an Exception becomes a message to share (a BaseException such as a kill is not
    caught: nothing is cleaned up, as after a real crash)."""
    try:
        return None, None, fn()
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        msg = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        return msg, exc, None


class Team:
    """Every rank a checkpoint operation spans: ``comm``'s group, times its replicate group on
    a 2-D mesh (hybrid sharding), where the replicas hold the same shards but must still agree:
    a rank that raised alone would leave the others in the next collective. Ranks are numbered
    ``replica * S + shard rank``, so on a flat group they are the group's ranks."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rep = getattr(comm, "replicate", None)
        self.shards = comm.world_size
        self.replica = 0 if self.rep is None else self.rep.rank
        self.rank = self.replica * self.shards + comm.rank
        self.world_size = self.shards * (1 if self.rep is None else self.rep.world_size)

    @property
    def writer(self) -> bool:
        """Whether this rank writes its shard rank's file: every rank of a flat group, the
        first replica of a mesh (the others hold copies of the same state)."""
        return self.replica == 0

    def all_gather_object(self, obj: Any, what: str, timeout: float | None = None) -> list[Any]:
        """Every rank's ``obj``, in team rank order (a collective of every rank); ``timeout``
        bounds each wait (CollectiveTimeout, arrival.py)."""
        mine = self.comm.all_gather_object(obj, what, timeout=timeout)
        if self.rep is None:
            return mine
        return [o for row in self.rep.all_gather_object(mine, what, timeout=timeout)
                for o in row]

    def where(self, r: int) -> str:
        if self.world_size == 1:
            return ""
        if self.rep is None:
            return f" (on rank {r})"
        replica, shard = divmod(r, self.shards)
        return f" (on replica {replica}, shard rank {shard})"


def agree(team: Team, what: str, msg: str | None, exc: BaseException | None, *,
          wait: float | None = None, call: str = "", path: str = "") -> list[Any]:
    """All-gather each rank's error (or None) over the whole team; raise the first on every
    rank. With ``call``, each wait is bounded by ``wait`` seconds (arrival.py)."""
    msgs = arrival.first_agreement(team, msg, "checkpoint status", wait, call, path) if call \
        else team.all_gather_object(msg, "checkpoint status")
    for r, m in enumerate(msgs):
        if m is not None:
            raise CheckpointError(f"{what}{team.where(r)}: {m}") \
                from (exc if r == team.rank else None)
    return msgs


Failure = tuple[int, str, "BaseException | None"]


def first_failure(team: Team, msgs: list[str | None],
                  exc: BaseException | None) -> Failure | None:
    """The first rank's error among everyone's ``msgs`` (gathered over ``team``): its team
    rank, the message, and this rank's exception if it is this rank's; None if none failed."""
    for r, m in enumerate(msgs):
        if m is not None:
            return r, m, exc if r == team.rank else None
    return None


def _discard(tmp: str) -> None:
    """Remove a failed save's staging directory. An error here is not raised over the save's
    own: the directory has no meta.json, and the next save removes it once unclaimed."""
    try:
        if os.path.isdir(tmp):
            remove_checkpoint_dir(tmp)
    except OSError:
        pass


def _prepare(path: str) -> tuple[str, StagingClaim]:
    """Make and claim this save's staging directory (under the publish lock, so a concurrent
    save's cleanup never sees it unclaimed)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with publishing(path):
        _check_target(path)
        nonce = secrets.token_hex(8)
        tmp = tmp_dir(path, nonce)
        os.mkdir(tmp)
        try:
            return nonce, StagingClaim(tmp)
        except BaseException:
            remove_checkpoint_dir(tmp)
            raise


def _check_target(path: str) -> None:
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} exists and is not a directory; not overwriting it")
        if os.listdir(path) and not os.path.exists(os.path.join(path, META)):
            raise CheckpointError(
                f"{path} is a non-empty directory that is not a zerokern "
                f"checkpoint (no {META}); not overwriting it"
            )


def _finish(path: str, tmp: str, nonce: str, meta: dict[str, Any], files: list[dict]) -> None:
    for f in files:
        p = os.path.join(tmp, f["name"])
        if not os.path.isfile(p) or os.path.getsize(p) != f["bytes"]:
            raise CheckpointError(
                f"rank 0 cannot see {f['name']} (written by rank {f['rank']}) with its "
                f"{f['bytes']} bytes in {tmp}: save_checkpoint needs a directory on a "
                f"filesystem shared by all ranks"
            )
    meta = {**meta, "save_id": nonce, "files": files}
    PieceIndex(meta).check(meta["params"])  # every element of every parameter, exactly once
    meta[META_DIGEST] = meta_digest(meta)
    # One top-level key per line, values compact: readable, and small for big piece tables.
    body = ",\n".join(
        f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in meta.items()
    )
    atomic_write_bytes(os.path.join(tmp, META), ("{\n" + body + "\n}\n").encode())
    fsync_dir(tmp)
    with publishing(path):  # no load reads PATH and no other save publishes meanwhile
        _check_target(path)
        # The owner marker stays out of the published checkpoint; without the lock a
        # concurrent cleanup could take the unmarked directory for a dead save's.
        if os.path.exists(os.path.join(tmp, OWNER)):
            os.unlink(os.path.join(tmp, OWNER))
        publish(tmp, path, nonce)
        for d in siblings(path):
            # Only what provably belongs to no live save: staging directories whose owner
            # is gone (crashed saves), and .old-* of an interrupted two-rename publish.
            if d.rsplit(".", 1)[-1].startswith("old-") or abandoned(d):
                remove_checkpoint_dir(d)


def save_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: Any, *, extra: Any = None
) -> str:
    """Save ``model`` and its ``ZeroAdamW`` optimizer to the directory ``path``; call on every
    rank. Each rank writes only what it owns; nothing is gathered. ``extra`` (JSON-serialisable:
    step counters, scheduler state, data-loader position) comes back from load_checkpoint.

    On a 2-D mesh (``ZeroAdamW(mesh=)``) the first replica writes one file per shard rank and
    the other replicas, which hold the same state, write nothing; they still call it (it
    agrees on errors across the whole mesh and returns on every rank together).

    Atomic: when this returns on any rank, ``path`` holds the complete new checkpoint; if it
    raises or the job dies before, ``path`` still holds the previous one (or nothing, if there
    was none). Needs a filesystem all ranks share. Returns the path.

    A collective: a rank that calls it alone (under ``if master_process:``) raises
    CollectiveTimeout naming it after ``$ZEROKERN_GATHER_TIMEOUT`` seconds (default 300 on
    gloo; on NCCL only when set), instead of waiting for the process group's timeout."""
    opt = optimizer
    comm = opt.comm
    team = Team(comm)
    leader = team.rank == 0  # the first replica's shard rank 0: stages and publishes
    path = os.path.normpath(os.fspath(path))
    what = f"save_checkpoint({path})"
    wait = arrival.limit(team)  # before anything is staged: a bad value is refused first
    msg, exc, plan = attempt(lambda: plan_save(model, opt, extra))
    if plan is not None and (entry := residual_entry(opt, team)) is not None:
        plan.meta[RESIDUALS] = entry  # error feedback's residuals (residuals.py)
    nonce = claim = None
    if leader and msg is None:
        msg, exc, staged = attempt(lambda: _prepare(path))
        if staged is not None:
            nonce, claim = staged
    failed: Failure | None = None
    try:
        # 1. every rank's plan, and the staging directory's nonce from the leader
        # Bounded: no collective runs before it, so a rank calling this alone (under `if
        # master_process:`) waits here, and is told instead of waiting in silence.
        try:
            status = arrival.first_agreement(team, (msg, nonce), "checkpoint plan", wait,
                                             "save_checkpoint", path)
        except CollectiveTimeout:
            if nonce is not None:  # nothing was written: leave no staging directory
                _discard(tmp_dir(path, nonce))
            raise
        failed = first_failure(team, [m for m, _ in status], exc)
        if failed is None:
            nonce = status[0][1]
            tmp = tmp_dir(path, nonce)
            # 2. the first replica writes; each shard group's file tables reach its rank 0
            msg = exc = info = None
            if team.writer:
                msg, exc, info = attempt(
                    lambda: write_rank_file(tmp, comm.rank, opt, plan, nonce))
            digest = None
            if msg is None and RESIDUALS in plan.meta:  # every rank: its own residuals
                msg, exc, digest = attempt(lambda: write_residuals(tmp, team.rank, opt))
            infos = comm.all_gather_object(info, "checkpoint file info")
            status = team.all_gather_object((msg, digest), "checkpoint files")
            failed = first_failure(team, [m for m, _ in status], exc)
            if failed is None and RESIDUALS in plan.meta:
                # Their sha256 in meta.json (itself digested): a load checks its file's.
                plan.meta[RESIDUALS] = {**plan.meta[RESIDUALS], "sha256": [d for _, d in status]}
        # 3. the leader publishes, or removes what was staged (the previous checkpoint stays)
        msg = exc = None
        if leader:
            if failed is None:
                msg, exc, _ = attempt(lambda: _finish(path, tmp, nonce, plan.meta, infos))
            if nonce is not None and (failed is not None or msg is not None):
                _discard(tmp_dir(path, nonce))
    finally:
        if claim is not None:
            claim.release()
    # Every rank leaves here, together: after the publish, or after the staging directory of
    # a failed save is gone, and with the same error.
    published = team.all_gather_object(msg, "checkpoint published")
    if failed is None:
        failed = first_failure(team, published, exc)
    if failed is not None:
        r, m, cause = failed
        raise CheckpointError(f"{what}{team.where(r)}: {m}") from cause
    return path
