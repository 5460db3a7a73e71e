"""The one comparison across ranks when a ZeroAdamW is built (and when ``parallelize`` starts,
and ``add_param_group`` adds a group): every rank sends what it was given in one gather, and
every rank reaches the same verdict from the same facts, before anything is modified and
before any other collective.

What is compared: the options of ``ZeroConfig.AGREED``, the mesh (none, or its ranks and
dims), each param group's hyperparameters and its count of trained parameters, and every
trained parameter's full shape and dtype. A check that failed on some rank travels in the
same gather, so every rank raises (the failing rank its own error, the others one naming
that rank) instead of the others waiting in a collective the failing rank never joins.

Without it, ranks built differently fail late and far from the cause: different moments
formats or bucket sizes give buckets of different sizes, and gloo aborts the process
(SIGABRT) in the first all-reduce; different seeds, master formats or learning rates train
the replicas apart without a word.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Comm
from ..comm.mesh import comm_of_mesh, describe_mesh, mesh_verdict
from .registry import runtime_of_param

NO_MESH = None
"""What a rank that was given no mesh sends as its mesh facts."""


def agreement_comm(comm: Comm | None = None, *, mesh: Any = None,
                   process_group: Any = None) -> Comm:
    """The group to compare over: with a mesh (given, or the one ``comm`` was built from),
    the default group, which the mesh must hold whole; else ``comm``, or
    ``process_group``'s. One gather over the default group instead of one per mesh dim, and
    a rank given a mesh meets a rank given none in the same collective."""
    if comm is not None:
        return Comm(None) if comm.mesh_ranks is not None else comm
    if mesh is not None:
        return Comm(None)
    return Comm(process_group)


def agree_at_construction(options: dict[str, Any] | None, failure: BaseException | None, *,
                          runtime: Any, mesh: Any, process_group: Any,
                          param_groups: list[dict[str, Any]], table: Any,
                          where: str = "ZeroAdamW", rule: Any = None) -> Comm:
    """ZeroAdamW's one comparison (``agree``) and, once every rank agrees, its Comm: the
    stage-3 runtime's, the mesh's, or ``process_group``'s.

    Args:
        options: ``ZeroConfig.agreed()`` (None where the options were refused).
        failure: this rank's refusal so far, or None.
        runtime: the shard_model runtime of the parameters (stage 3), or None.
        mesh: the ``mesh`` argument.
        process_group: the ``process_group`` argument.
        param_groups: the optimizer's param groups (those torch's constructor made).
        table: the ParamTable, or None where it was not built (a refusal).
        where: the call, for the errors.
        rule: the update rule (its hyperparameters are compared), or None for AdamW's.
    """
    if runtime is None and failure is not None:
        # Refused before the runtime was looked up: its group, if the parameters have one,
        # is where the other ranks compare.
        runtime = next((rt for g in param_groups for p in g.get("params", [])
                        if torch.is_tensor(p) and (rt := runtime_of_param(p)) is not None),
                       None)
    # Stage 3: the model's mesh was agreed by shard_model; the optimizer's is checked
    # against it on this rank (check_same_mesh).
    own_mesh = None if runtime is not None else mesh
    mesh_facts = (NO_MESH if own_mesh is None
                  else describe_mesh(own_mesh, process_group, where))
    try:
        group = agreement_comm(None if runtime is None else runtime.comm, mesh=own_mesh,
                               process_group=process_group)
    except (ValueError, RuntimeError):
        if failure is not None:
            raise failure from None  # the first refusal, as without a group to tell
        raise
    known = failure is None and table is not None
    agree(group, where, options=options, failure=failure, mesh=mesh_facts,
          groups=group_facts(param_groups, table.group_counts(), hyper_keys(rule))
          if known else None,
          params=param_facts(table.shapes, table.params) if known else None)
    if runtime is not None:
        return runtime.comm
    return comm_of_mesh(own_mesh) if own_mesh is not None else group


ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


def hyper_keys(rule: Any) -> tuple[str, ...]:
    """The param-group keys compared across ranks: a torch class's hyperparameters (every key
    of its defaults: flags such as ``foreach`` change its rounding), else AdamW's four."""
    from .rules import TorchClassRule  # here: rules import validation that imports this

    return tuple(rule.defaults) if isinstance(rule, TorchClassRule) else ADAMW_KEYS


def group_facts(param_groups: list[dict[str, Any]], counts: list[int],
                keys: tuple[str, ...] = ADAMW_KEYS) -> list[dict[str, Any]]:
    """Each param group's hyperparameters ``keys`` (plain values) and count of trained
    parameters."""
    out = []
    for g, n in zip(param_groups, counts):
        out.append({**{k: _plain(g.get(k)) for k in keys}, "trained": n})
    return out


def _plain(v: Any) -> Any:
    """A hyperparameter as a value every rank compares alike (numbers as floats)."""
    if torch.is_tensor(v):
        return tuple(float(x) for x in v.reshape(-1).tolist()) if v.numel() != 1 \
            else float(v)
    if isinstance(v, (tuple, list)):
        return tuple(_plain(x) for x in v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return v if v is None or isinstance(v, (bool, str)) else repr(v)


def param_facts(shapes: list[torch.Size], params: list[torch.nn.Parameter],
                ) -> list[tuple[tuple[int, ...], str]]:
    """Each trained parameter's full shape and dtype."""
    return [(tuple(sh), str(p.dtype)) for sh, p in zip(shapes, params)]


def agree(comm: Comm, where: str, *, options: dict[str, Any] | None = None,
          failure: BaseException | None = None, mesh: Any = NO_MESH,
          groups: list[dict[str, Any]] | None = None,
          params: list[tuple[tuple[int, ...], str]] | None = None) -> None:
    """Gather this rank's facts over ``comm`` (one collective) and raise on every rank when
    some rank failed or the ranks differ.

    Args:
        comm: the group to compare over (``agreement_comm``).
        where: the call, named in the errors (``"ZeroAdamW"``, ``"parallelize"``, ...).
        options: ``ZeroConfig.agreed()``; None where the options were refused.
        failure: this rank's refusal so far, or None (raised here, after the gather,
            unless the ranks' options differ: that is raised instead, on every rank).
        mesh: ``comm.mesh.describe_mesh(...)`` of a given mesh; ``NO_MESH`` without one.
        groups: ``group_facts``, or None where not known (compared only when every rank
            sent them).
        params: ``param_facts``, or None where not known (as ``groups``).

    Raises:
        ValueError: on every rank: another rank's refusal, a mesh mistake, options or
            hyperparameters that differ (each named, with every rank's value), or parameter
            lists that differ.
        Exception: on a rank with ``failure``, that failure itself.
    """
    mine = {"where": where, "error": None if failure is None else _describe(failure),
            "options": options, "mesh": mesh, "groups": groups, "params": params}
    gathered = comm.all_gather_object(mine, f"{where} options")
    # Options that differ are the likelier cause of a refusal on some rank (a rank given
    # stage=2 refuses a sharded model): every rank names them first.
    message = _options_verdict(gathered, where)
    if message is None and failure is not None:
        raise failure
    message = message or verdict(gathered, where)
    if message is not None:
        raise ValueError(message)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _options_verdict(gathered: list[dict[str, Any]], where: str) -> str | None:
    """The options (and hyperparameters) that differ, where every rank sent its own."""
    if any(f["options"] is None for f in gathered):
        return None
    diffs = _option_diffs(gathered)
    if not diffs:
        return None
    return f"{where}: options differ across ranks (every rank must give the same): " + \
        "; ".join(diffs)


def verdict(gathered: list[dict[str, Any]], where: str) -> str | None:
    """The first problem in every rank's facts (pure: the same on every rank), or None:
    options that differ, a rank's refusal, ranks in different calls, a mesh mistake,
    parameter lists that differ."""
    message = _options_verdict(gathered, where)
    if message is not None:
        return message
    failed = [r for r, f in enumerate(gathered) if f["error"] is not None]
    if failed:
        r = failed[0]
        also = f" (and on {_ranks(failed[1:])})" if len(failed) > 1 else ""
        return f"{where} failed on rank {r}{also}: {gathered[r]['error']}"
    calls = [f["where"] for f in gathered]
    if len(set(calls)) > 1:
        return (f"{where}: the ranks are in different calls ({_by_value(calls, str)}); "
                "every rank must make the same call")
    message = _mesh_verdict([f["mesh"] for f in gathered], where)
    if message is not None:
        return message
    return _param_verdict(gathered)


def _mesh_verdict(meshes: list[Any], where: str) -> str | None:
    given = [m is not NO_MESH for m in meshes]
    if not any(given):
        return None
    if not all(given):
        shown = ["no mesh" if m is NO_MESH else
                 f"a mesh {m[1][0]}" if m[1] is not None else "a mesh" for m in meshes]
        return (f"{where}: mesh differs across ranks: {_by_value(shown, str)}; give every "
                "rank the same mesh, or none")
    return mesh_verdict(meshes, len(meshes), where)


def _option_diffs(gathered: list[dict[str, Any]]) -> list[str]:
    diffs: list[str] = []
    names = list(gathered[0]["options"] or {})
    for name in names:
        values = [(f["options"] or {}).get(name) for f in gathered]
        if any(v != values[0] for v in values):
            diffs.append(f"{name} is {_by_value(values)}")
    groups = [f["groups"] for f in gathered]
    if any(g is None for g in groups):
        return diffs
    counts = [len(g) for g in groups]
    if any(c != counts[0] for c in counts):
        diffs.append(f"the number of param groups is {_by_value(counts)}")
        return diffs
    for gi in range(counts[0]):
        for key in [k for k in groups[0][gi] if k != "trained"]:
            values = [g[gi].get(key) for g in groups]
            if any(v != values[0] for v in values):
                diffs.append(f"{key} (param group {gi}) is {_by_value(values)}")
    return diffs


def _param_verdict(gathered: list[dict[str, Any]]) -> str | None:
    if any(f["params"] is None or f["groups"] is None for f in gathered):
        return None
    counts = [[g["trained"] for g in f["groups"]] for f in gathered]
    if any(c != counts[0] for c in counts):
        return (f"parameter lists differ across ranks: trained parameters per param group "
                f"are {_by_value(counts)}; build the same model on every rank")
    ref = gathered[0]["params"]
    for r, f in enumerate(gathered):
        other = f["params"]
        if len(other) != len(ref):
            return (f"parameter lists differ across ranks: rank 0 has {len(ref)} trainable "
                    f"parameters, rank {r} has {len(other)}")
        for i, (a, b) in enumerate(zip(ref, other)):
            if a != b:
                return (f"parameter lists differ across ranks: parameter {i} is {a[0]} "
                        f"{a[1]} on rank 0 but {b[0]} {b[1]} on rank {r}; build the same "
                        "model on every rank")
    return None


def _by_value(values: list[Any], show: Any = repr) -> str:
    """``'int8' on rank 0, 'fp32' on ranks 1-3``: each value once, with its ranks."""
    order: list[Any] = []
    ranks: list[list[int]] = []
    for r, v in enumerate(values):
        for k, seen in enumerate(order):
            if seen == v:
                ranks[k].append(r)
                break
        else:
            order.append(v)
            ranks.append([r])
    return ", ".join(f"{show(v)} on {_ranks(rs)}" for v, rs in zip(order, ranks))


def _ranks(rs: list[int]) -> str:
    """``rank 3``, ``ranks 0, 2``, ``ranks 1-3``."""
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts: list[str] = []
    start = prev = rs[0]
    for r in rs[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ", ".join(parts)
