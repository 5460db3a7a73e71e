"""meta.json checked as a whole, before a load changes anything.

load.open_checkpoint calls check_meta on the parsed meta.json and check_rank_file on every rank
file's parsed safetensors header; both are pure functions of what was parsed, and every refusal
is a CheckpointError naming the file and the field. Once they pass, apply() has nothing left to
fail on but I/O: without them a bad group index or a deleted hyperparameter surfaced half-way
through a load, and a negative piece offset or a file name like ``../x`` loaded the wrong bytes
silently.

The allowed keys are exactly those save.py writes (plan_save, _finish): a key it does not write
means the file was edited or comes from a zerokern this one does not know. Hyperparameters get
the checks of ZeroAdamW's constructor (zero/validate.py), the loss-scaler entry the shape of
LossScaler.state_dict(). The meta_sha256 digest (format version 2) comes first: an edit that
keeps every value plausible (two same-size pieces swapped) is caught only by it.

A compressed state (moments.py) adds two optional entries, written only for it: the top-level
``state_format`` and each file's ``moments`` table. Without them a meta.json is checked as
before; a zerokern that predates them refuses such a checkpoint by the unknown entry's name.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

import torch

from ..zero.scaler import LossScaler
from ..zero.validate import check_hparams
from .format import (
    FORMAT,
    FORMAT_VERSION,
    FROZEN_KINDS,
    META,
    META_DIGEST,
    STATE,
    CheckpointError,
    PieceIndex,
    TensorInfo,
    dtype_from_name,
    dtype_name,
    is_count,
    meta_digest,
    rank_file,
)
from .moments import (
    MOMENTS,
    MOMENTS_TABLE,
    STATE_FORMAT,
    MomentIndex,
    absmax_name,
    blockwise,
    check_state_format,
    check_table_tiling,
    expected_tensors,
    has_table,
    tensor_name,
    values_dtype,
)
from .optimizer_entry import OPTIMIZER, check_entry, check_hyper, state_tensors
from .residuals import RESIDUALS, residual_entry_error

# meta.json's top-level keys (plan_save, then _finish: save_id, files; META_DIGEST from format
# version 2 on, where it is required).
KEYS = frozenset({
    "format", "format_version", "zerokern_version", "torch_version", "created_ns",
    "world_size", "stage", "param_dtype", "params", "aliases", "state_dict_keys", "buffers",
    "param_groups", "ready_order", "scaler", "extra", "save_id", "files",
})
# Optional: the 2-D mesh a hybrid-sharded run saved from (save.mesh_entry), for information.
MESH = "mesh"
MESH_KEYS = frozenset({"shape", "dim_names"})
PARAM_KEYS = frozenset({"shape", "dtype", "managed", "group", "step"})
BUFFER_KEYS = frozenset({"shape", "dtype"})
GROUP_KEYS = frozenset({"hyper", "params"})
FILE_KEYS = frozenset({"name", "rank", "bytes", "sha256", "pieces", "buffers"})
# A param group's entries besides "params": ZeroAdamW's own, and those torch puts there:
# "param_names" (an optimizer built from named_parameters()), "differentiable" (set when an
# optimizer is unpickled) and the LR schedulers' bookkeeping (initial_lr: every scheduler;
# max_lr, min_lr, base_momentum, max_momentum: OneCycleLR, CyclicLR; swa_lr: SWALR).
HYPER_REQUIRED = ("lr", "betas", "eps", "weight_decay")
HYPER_RATES = frozenset({"initial_lr", "max_lr", "min_lr", "swa_lr", "base_momentum",
                         "max_momentum"})
HYPER_KEYS = frozenset(HYPER_REQUIRED) | HYPER_RATES | {"param_names", "differentiable"}
# LossScaler.state_dict(): its fields, each of the type of the field's default.
SCALER_TYPES = {f.name: type(f.default) for f in dataclasses.fields(LossScaler)}
_SCALER_POSITIVE = frozenset({"scale", "growth_interval", "growth_factor", "backoff_factor",
                              "min_scale"})
PARAM_DTYPES = frozenset({"float32", "bfloat16", "float16"})  # what ZeroAdamW trains
DTYPE_NAMES = frozenset(dtype_name(dt) for dt in FROZEN_KINDS.values())  # safetensors' dtypes
_FILE_NAME = re.compile(r"rank[0-9]{5,}\.safetensors")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _got(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _member(v: Any, allowed: frozenset | dict) -> bool:
    return isinstance(v, str) and v in allowed


def _number(v: Any) -> bool:
    """A JSON number (int or float, not bool) that is finite and >= 0."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
        and v >= 0


class _Fields:
    """Checks of meta.json's fields; a failure names meta.json, its directory and the field."""

    def __init__(self, d: str) -> None:
        self.at = f"{META} in {d}"

    def error(self, field: str, why: str) -> CheckpointError:
        return CheckpointError(f"{self.at}: {field} {why}")

    def require(self, ok: bool, field: str, what: str, v: Any) -> None:
        if not ok:
            raise self.error(field, f"must be {what}, got {_got(v)}")

    def keys(self, obj: Any, field: str, allowed: frozenset, required: frozenset) -> None:
        self.require(isinstance(obj, dict), field, "a JSON object", obj)
        missing = sorted(required - obj.keys())
        if missing:
            raise self.error(field, f"lacks the entry {missing[0]!r}")
        unknown = sorted(k for k in obj if k not in allowed)
        if unknown:
            raise self.error(field, f"has an unknown entry {unknown[0]!r} (known: "
                                    f"{', '.join(sorted(allowed))})")

    def names(self, v: Any, field: str, known: Any = None, what: str = "") -> list[str]:
        """A list of distinct strings, each in ``known`` (if given)."""
        self.require(isinstance(v, list) and all(isinstance(x, str) for x in v), field,
                     "a list of names", v)
        seen: set[str] = set()
        for k, x in enumerate(v):
            if x in seen:
                raise self.error(f"{field}[{k}]", f"repeats {x!r}")
            if known is not None and x not in known:
                raise self.error(f"{field}[{k}]", f"must be {what}, got {x!r}")
            seen.add(x)
        return v

    def tensor_entry(self, obj: Any, field: str, keys: frozenset) -> None:
        """A parameter's or buffer's entry: exactly ``keys``, among them shape and dtype."""
        self.keys(obj, field, keys, keys)
        shape = obj["shape"]
        self.require(isinstance(shape, list) and all(is_count(s) for s in shape),
                     f"{field}.shape", "a list of integers >= 0", shape)
        self.require(_member(obj["dtype"], DTYPE_NAMES), f"{field}.dtype", "a dtype name",
                     obj["dtype"])


def check_meta(meta: Any, d: str) -> PieceIndex:
    """All of a parsed meta.json in directory ``d``; returns its piece index, checked to tile
    every parameter. Needs no model: what depends on one is load.match's."""
    c = _Fields(d)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{os.path.join(d, META)} is not a zerokern checkpoint's {META}")
    version = meta.get("format_version")
    c.require(is_count(version) and version >= 1, "format_version", "an integer >= 1", version)
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{c.at}: format version {version} was written by a newer zerokern (this one "
            f"reads up to {FORMAT_VERSION})"
        )
    _check_digest(c, meta, version)
    c.keys(meta, "the top level",
           KEYS | {META_DIGEST, STATE_FORMAT, MESH, OPTIMIZER, RESIDUALS},
           KEYS | ({META_DIGEST} if version >= 2 else frozenset()))
    for key in ("zerokern_version", "torch_version", "save_id"):
        c.require(isinstance(meta[key], str) and meta[key] != "", key, "a string", meta[key])
    c.require(is_count(meta["created_ns"]), "created_ns", "an integer >= 0", meta["created_ns"])
    world = meta["world_size"]
    c.require(is_count(world) and world >= 1, "world_size", "an integer >= 1", world)
    if MESH in meta:
        _check_mesh(c, meta[MESH], world)
    c.require(meta["stage"] in (0, 1, 2, 3) and is_count(meta["stage"]), "stage",
              "0, 1, 2 or 3", meta["stage"])
    c.require(_member(meta["param_dtype"], PARAM_DTYPES), "param_dtype",
              f"one of {', '.join(sorted(PARAM_DTYPES))}", meta["param_dtype"])
    c.require(isinstance(meta["param_groups"], list), "param_groups", "a list",
              meta["param_groups"])
    _check_params(c, meta["params"], len(meta["param_groups"]))
    _check_buffers(c, meta["buffers"])
    _check_names(c, meta)
    if OPTIMIZER in meta:  # the state of another rule than AdamW's
        check_entry(meta, c.error)
    _check_groups(c, meta["param_groups"], meta["params"], OPTIMIZER in meta)
    _check_scaler(c, meta["scaler"])
    if STATE_FORMAT in meta:
        check_state_format(meta[STATE_FORMAT], meta["param_dtype"], c.error)
    _check_files(c, meta)
    if RESIDUALS in meta and (why := residual_entry_error(meta[RESIDUALS])) is not None:
        raise c.error(RESIDUALS, why)
    if has_table(meta):
        MomentIndex(meta, c.at).check(meta["params"], meta[STATE_FORMAT]["moments"])
    index = PieceIndex(meta, c.at)
    index.check(meta["params"])
    for name, p in meta["params"].items():
        kind = index.kind(name)  # None: no elements
        if kind is not None and (kind == "state") != p["managed"]:
            raise c.error(
                f"params[{name!r}]",
                f"is {'' if p['managed'] else 'not '}trained (managed) but its pieces are in "
                f"tensor {kind!r}",
            )
    return index


def _check_digest(c: _Fields, meta: dict[str, Any], version: int) -> None:
    """meta_sha256 is required from format version 2 on; a version-1 meta.json (written before
    2026-12) has none, but one that has it is held to it (a version edited down to 1 does not
    escape the check while the digest stays)."""
    digest = meta.get(META_DIGEST)
    if digest is None:
        if version >= 2:
            raise c.error(META_DIGEST, f"is missing (required from format version 2 on; "
                                       f"this one is {version})")
        return
    if digest != meta_digest(meta):
        raise c.error(META_DIGEST, "does not match the content: meta.json was edited or "
                                   "damaged after the save")


def _check_mesh(c: _Fields, mesh: Any, world: int) -> None:
    """The saving mesh (R, S): S is the number of files (``world_size``), the one number a
    load uses; the rest only describes the run that saved."""
    c.keys(mesh, MESH, MESH_KEYS, MESH_KEYS)
    shape = mesh["shape"]
    c.require(isinstance(shape, list) and len(shape) == 2
              and all(is_count(n) and n >= 1 for n in shape), f"{MESH}.shape",
              "[replicas, shard ranks], two integers >= 1", shape)
    c.require(shape[1] == world, f"{MESH}.shape", f"[replicas, {world}] (world_size: the "
              "shard ranks that wrote the files)", shape)
    names = mesh["dim_names"]
    c.require(names is None or (isinstance(names, list) and len(names) == 2
                                and all(isinstance(n, str) for n in names)),
              f"{MESH}.dim_names", "null or two strings", names)


def _check_params(c: _Fields, params: Any, n_groups: int) -> None:
    c.require(isinstance(params, dict), "params", "a JSON object", params)
    for name, p in params.items():
        field = f"params[{name!r}]"
        c.tensor_entry(p, field, PARAM_KEYS)
        c.require(isinstance(p["managed"], bool), f"{field}.managed", "true or false",
                  p["managed"])
        g = p["group"]
        if p["managed"] or g is not None:  # a frozen parameter may sit in a group or none
            c.require(is_count(g) and g < n_groups, f"{field}.group",
                      f"a param group index below {n_groups}", g)
        if p["managed"]:
            c.require(is_count(p["step"]), f"{field}.step", "an integer >= 0 (a trained "
                      "parameter's step count)", p["step"])
        else:
            c.require(p["step"] is None, f"{field}.step", "null (not trained)", p["step"])


def _check_buffers(c: _Fields, buffers: Any) -> None:
    c.require(isinstance(buffers, dict), "buffers", "a JSON object", buffers)
    for name, b in buffers.items():
        c.tensor_entry(b, f"buffers[{name!r}]", BUFFER_KEYS)


def _check_names(c: _Fields, meta: dict[str, Any]) -> None:
    """aliases, state_dict_keys, ready_order: names of what meta.json describes."""
    params, buffers, aliases = meta["params"], meta["buffers"], meta["aliases"]
    c.require(isinstance(aliases, dict), "aliases", "a JSON object", aliases)
    for k, v in aliases.items():
        c.require(k not in params and k not in buffers, f"aliases[{k!r}]",
                  "a name that is not a parameter or buffer itself", k)
        c.require(_member(v, params) or _member(v, buffers), f"aliases[{k!r}]",
                  "a parameter or buffer", v)
    c.names(meta["state_dict_keys"], "state_dict_keys",
            params.keys() | buffers.keys() | aliases.keys(), "a parameter, buffer or alias")
    if meta["ready_order"] is not None:
        trained = {n for n, p in params.items() if p["managed"]}
        c.names(meta["ready_order"], "ready_order", trained, "a trained parameter")


def _check_groups(c: _Fields, groups: list, params: dict[str, Any],
                  torch_class: bool = False) -> None:
    """Each group's hyperparameters, and its parameter list agreeing with params[...].group."""
    listed: dict[str, int] = {}
    for g, grp in enumerate(groups):
        field = f"param_groups[{g}]"
        c.keys(grp, field, GROUP_KEYS, GROUP_KEYS)
        for k, n in enumerate(c.names(grp["params"], f"{field}.params", params,
                                      "a parameter")):
            if n in listed:
                raise c.error(f"{field}.params[{k}]",
                              f"is {n!r}, which param_groups[{listed[n]}] lists too")
            if params[n]["group"] != g:
                raise c.error(f"{field}.params[{k}]",
                              f"is {n!r}, whose params[{n!r}].group is {params[n]['group']}")
            listed[n] = g
        if torch_class:  # a torch class's hyperparameters: checked by the class at load
            c.require(isinstance(grp["hyper"], dict), f"{field}.hyper", "a JSON object",
                      grp["hyper"])
            check_hyper(grp["hyper"], f"{field}.hyper", c.error)
        else:
            _check_hyper(c, grp["hyper"], f"{field}.hyper", len(grp["params"]))
    for n, p in params.items():
        if p["group"] is not None and n not in listed:
            raise c.error(f"params[{n!r}].group",
                          f"is {p['group']} but param_groups[{p['group']}] does not list it")


def _check_hyper(c: _Fields, h: Any, field: str, n_params: int) -> None:
    c.keys(h, field, HYPER_KEYS, frozenset(HYPER_REQUIRED))
    for k in ("lr", "eps", "weight_decay", *sorted(HYPER_RATES & h.keys())):
        c.require(_number(h[k]), f"{field}.{k}", "a finite number >= 0", h[k])
    betas = h["betas"]
    c.require(isinstance(betas, list) and len(betas) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas),
        f"{field}.betas", "a pair of numbers [beta1, beta2]", betas)
    try:  # the ranges, as ZeroAdamW's constructor checks them
        check_hparams(h["lr"], betas, h["eps"], h["weight_decay"])
    except ValueError as exc:
        raise CheckpointError(f"{c.at}: {field}.{exc}") from None
    if "param_names" in h:
        names = c.names(h["param_names"], f"{field}.param_names")
        c.require(len(names) == n_params, f"{field}.param_names",
                  f"{n_params} names, one per parameter of the group", names)
    if "differentiable" in h:
        c.require(h["differentiable"] is False, f"{field}.differentiable", "false",
                  h["differentiable"])


def _check_scaler(c: _Fields, s: Any) -> None:
    if s is None:
        return
    c.keys(s, "scaler", frozenset(SCALER_TYPES), frozenset(SCALER_TYPES))
    for k, typ in SCALER_TYPES.items():
        v, field = s[k], f"scaler.{k}"
        if typ is bool:
            c.require(isinstance(v, bool), field, "true or false", v)
        elif typ is int:
            c.require(is_count(v) and (v > 0 or k not in _SCALER_POSITIVE), field,
                      f"an integer {'> 0' if k in _SCALER_POSITIVE else '>= 0'}", v)
        else:
            c.require(_number(v) and (v > 0 or k not in _SCALER_POSITIVE), field,
                      f"a finite number {'> 0' if k in _SCALER_POSITIVE else '>= 0'}", v)


def _check_files(c: _Fields, meta: dict[str, Any]) -> None:
    """One entry per saving rank, in rank order, each naming a plain file inside the
    directory: a name with a path in it (``../x/rank00000.safetensors``, an absolute path)
    would be opened wherever it points."""
    files, world = meta["files"], meta["world_size"]
    c.require(isinstance(files, list) and len(files) == world, "files",
              f"a list of {world} entries, one per saving rank (world_size)", files)
    holder: dict[str, int] = {}
    table = has_table(meta)
    for i, f in enumerate(files):
        field = f"files[{i}]"
        c.keys(f, field, FILE_KEYS | ({MOMENTS_TABLE} if table else frozenset()),
               FILE_KEYS | ({MOMENTS_TABLE} if table else frozenset()))
        if table:
            c.require(isinstance(f[MOMENTS_TABLE], list), f"{field}.{MOMENTS_TABLE}", "a list",
                      f[MOMENTS_TABLE])
        c.require(isinstance(f["name"], str) and _FILE_NAME.fullmatch(f["name"]) is not None,
                  f"{field}.name", "a plain file name rankNNNNN.safetensors inside the "
                  "checkpoint directory", f["name"])
        c.require(f["rank"] == i and is_count(f["rank"]), f"{field}.rank", f"{i}", f["rank"])
        c.require(f["name"] == rank_file(i), f"{field}.name", f"{rank_file(i)!r} (rank {i})",
                  f["name"])
        c.require(is_count(f["bytes"]), f"{field}.bytes", "an integer >= 0", f["bytes"])
        c.require(isinstance(f["sha256"], str) and _SHA256.fullmatch(f["sha256"]) is not None,
                  f"{field}.sha256", "64 lowercase hex digits", f["sha256"])
        c.require(isinstance(f["pieces"], list), f"{field}.pieces", "a list", f["pieces"])
        for k, b in enumerate(c.names(f["buffers"], f"{field}.buffers", meta["buffers"],
                                      "a buffer")):
            if b in holder:
                raise c.error(f"{field}.buffers[{k}]", f"is {b!r}, which files[{holder[b]}] "
                                                       "holds too")
            holder[b] = i
    missing = [b for b in meta["buffers"] if b not in holder]
    if missing:
        raise c.error("buffers", f"has {missing[0]!r}, which no files[i].buffers lists")


def check_rank_file(meta: dict[str, Any], i: int, tensors: dict[str, TensorInfo],
                    header_meta: dict[str, str], path: str) -> None:
    """Rank file ``files[i]`` (its header parsed by format.read_header) against meta.json
    (checked by check_meta): written by the same save, holding exactly the tensors meta.json
    names with their dtypes and shapes, and its piece rows tiling each stored tensor, so that
    every read apply() makes is in bounds."""
    f = meta["files"][i]

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{f['name']} does not match {META} ({path}): {why}")

    want = {"format": FORMAT, "rank": str(f["rank"]), "save_id": meta["save_id"]}
    for k, v in want.items():
        if header_meta.get(k) != v:
            raise bad(f"its header has {k} {header_meta.get(k)!r}, {META} says {v!r} for "
                      f"files[{i}] (a rank file of another save?)")
    kinds = {row[3] for row in f["pieces"]}
    rows = f.get(MOMENTS_TABLE)
    # The state triple is always written (1-D, one length), even when empty: fp32, but the
    # values of master="none" are the bf16 parameters; with a moments table only the values.
    expect: dict[str, tuple[torch.dtype, tuple[int, ...] | None]] = {
        t: (torch.float32, None) for t in (state_tensors(meta) if rows is None else STATE[:1])
    }
    expect["master"] = (values_dtype(meta), None)
    if rows is not None:
        expect.update({t: (dt, None) for t, dt in expected_tensors(rows).items()})
    expect.update({k: (FROZEN_KINDS[k], None) for k in kinds if k != "state"})
    for b in f["buffers"]:
        spec = meta["buffers"][b]
        expect[f"buffer/{b}"] = (dtype_from_name(spec["dtype"]), tuple(spec["shape"]))
    for t in tensors:
        if t not in expect:
            raise bad(f"it holds tensor {t!r}, which files[{i}] does not name")
    for t, (dtype, shape) in expect.items():
        info = tensors.get(t)
        if info is None:
            raise bad(f"tensor {t!r} is missing")
        if info.dtype != dtype or (info.shape != shape if shape is not None
                                   else len(info.shape) != 1):
            raise bad(f"tensor {t!r} is {info.dtype} of shape {list(info.shape)}, expected "
                      f"{dtype} of shape {list(shape) if shape is not None else '[n]'}")
    same = [state_tensors(meta)] if rows is None else [
        [tensor_name(k, fmt) for k in MOMENTS] for fmt in {r[3] for r in rows}] + [
        [absmax_name(k) for k in MOMENTS] for fmt in {r[3] for r in rows} if blockwise(fmt)]
    for group in same:
        if len({tensors[t].numel for t in group}) != 1:
            raise bad(f"tensors {', '.join(group)} differ in length")
    if rows is not None:
        check_table_tiling(rows, tensors, bad, i)
    for kind in kinds | {"state"}:
        stored = tensors["master" if kind == "state" else kind].numel
        rows = sorted((row[4], row[2], j) for j, row in enumerate(f["pieces"])
                      if row[3] == kind)
        pos = 0
        for off, n, j in rows:
            if off + n > stored:
                raise bad(f"files[{i}].pieces[{j}] reads elements [{off}, {off + n}) of "
                          f"tensor {kind!r}, which has {stored}")
            if off != pos:
                raise bad(f"the pieces in tensor {kind!r} leave a gap or overlap at element "
                          f"{pos} (files[{i}].pieces[{j}])")
            pos += n
        if pos != stored:
            raise bad(f"the pieces in tensor {kind!r} cover {pos} of its {stored} elements")
