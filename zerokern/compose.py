"""How a model and its ZeroAdamW are put together, in one place: ``parallelize``.

The rule, which every integration, the demo, the benchmarks and the example follow:

1. at stage 3 the model is partitioned by ``shard_model`` *before* the optimizer is built
   (ZeroAdamW(stage=3) finds the stage-3 runtime through the parameters), with the given
   unit classes (classes or class names), else the model's ``_no_split_modules`` (Hugging
   Face models: the blocks HF's FSDP auto-wrap shards by), else ``shard_model``'s default;
   at stages 0-2 the model is left as it is and the stage-3 options are ignored, so that one
   call serves every stage;
2. ``offload_params=True`` (parameter shards in host memory) is stage 3 only and needs
   ``offload="cpu"`` (the step then runs where the parameters are);
3. the optimizer is ``ZeroAdamW(params, stage=stage, offload=offload, ...)`` over the model's
   parameters (or the given ones, param-group dicts allowed).

``parallelize`` does all three. ``shard_for`` is its first half alone, for a trainer that must
build the optimizer later than it prepares the model (Lightning's ``configure_optimizers``,
the HF Trainer's ``create_optimizer``): ``shard_for`` then ``ZeroAdamW(..., stage=stage)``
is exactly what ``parallelize`` does. torchtitan's per-model ``parallelize`` function plays
the same part there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .comm.mesh import describe_mesh
from .zero import ZeroAdamW, shard_model
from .zero.agreement import NO_MESH, agree, agreement_comm
from .zero.config import ZeroConfig, check_offload_params_stage
from .zero.interchange import check_adamw_flags
from .zero.param_table import trained_params
from .zero.validate import (
    check_eps_moments,
    check_hparams,
    check_master_dtype,
    common_dtype_device,
)

__all__ = ["parallelize", "prepare_model", "resolve_units", "shard_for"]


def _check_stage(stage: Any) -> None:
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")


def _units_by_name(model: nn.Module, names: Iterable[str], caller: str) -> tuple[type, ...]:
    wanted = set(names)
    found = {type(m) for m in model.modules() if type(m).__name__ in wanted}
    missing = wanted - {c.__name__ for c in found}
    if missing:
        raise ValueError(f"{caller}: unit class {sorted(missing)[0]!r} (from unit_classes or "
                         f"the model's _no_split_modules) is not a module of the model")
    return tuple(sorted(found, key=lambda c: c.__name__))


def resolve_units(model: nn.Module, unit_classes: Iterable[type | str] | None, *,
                  caller: str = "shard_for") -> tuple[type, ...] | None:
    """The stage-3 unit classes of ``model``.

    Args:
        model: the model to partition.
        unit_classes: module classes or class names (names are looked up among the model's
            modules); None: the model's ``_no_split_modules`` if it has them (the blocks
            HF's FSDP auto-wrap policy shards by), else None.
        caller: what the error messages name as the caller.

    Returns:
        The classes, or None for ``shard_model``'s default choice.

    Raises:
        ValueError: a class name that is no module of the model.
        TypeError: an entry that is neither a class nor a name.
    """
    if unit_classes is None:
        names = getattr(model, "_no_split_modules", None)
        return _units_by_name(model, names, caller) if names else None
    given = list(unit_classes)
    classes = [c for c in given if isinstance(c, type)]
    names = [c for c in given if isinstance(c, str)]
    if len(classes) + len(names) != len(given):
        raise TypeError(f"{caller}: unit_classes must hold module classes or class names")
    return tuple(classes) + (_units_by_name(model, names, caller) if names else ())


def shard_for(
    model: nn.Module,
    *,
    stage: int,
    unit_classes: Iterable[type | str] | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
    offload_params: bool = False,
    gather_timeout: float | None = None,
    process_group: Any = None,
    mesh: Any = None,
    hpz: bool = False,
) -> nn.Module:
    """Prepare ``model`` for a ZeroAdamW of ``stage``: the first half of ``parallelize``.

    At stage 3: ``shard_model(model, ...)`` with the unit classes resolved by
    ``resolve_units`` (the given classes or class names, else the model's
    ``_no_split_modules``, else ``shard_model``'s default). At stages 0-2 the model is
    returned as it is and the stage-3 options (``unit_classes``, ``prefetch``,
    ``reshard_after_forward``, ``gather_timeout``) are ignored, as ZeroAdamW ignores
    ``bucket_numel`` at stage 3. Build the optimizer afterwards with
    ``ZeroAdamW(params, stage=stage, ...)`` (with ``offload="cpu"`` if ``offload_params``).

    Args:
        model: the model, already on its device and in its dtype, not wrapped in DDP.
        stage: the ZeRO stage the optimizer will run (0-3).
        unit_classes: stage 3: the module classes (or class names) that become units.
        prefetch: stage 3: how many units are gathered ahead.
        reshard_after_forward: stage 3: release each unit after its forward.
        offload_params: stage 3 only: keep the parameter shards in host memory.
        gather_timeout: stage 3: the longest wait, in seconds, in one unit's collective.
        process_group: the group whose ranks share the work; default the world.
        mesh: instead of ``process_group``, a 1-D or 2-D DeviceMesh (stage 3: the model is
            sharded over its shard dim; docs/hybrid.md).
        hpz: stage 3, 2-D ``mesh``: ZeRO++'s hpZ (``shard_model(hpz=True)``).

    Returns:
        ``model`` itself (partitioned in place at stage 3).

    Raises:
        ValueError: a stage outside 0-3, ``offload_params`` at stages 0-2, or what
            ``shard_model`` refuses (unit classes that match no module, arguments that
            differ across ranks), before the model is modified.
        TypeError: ``unit_classes`` entries that are neither classes nor names, or an
            ``offload_params`` that is not a bool.
        RuntimeError: the model is already sharded (``shard_model`` called before).
    """
    _check_stage(stage)
    check_offload_params_stage(offload_params, stage)
    if stage != 3:
        return model
    units = resolve_units(model, unit_classes)
    return shard_model(
        model, process_group=process_group, unit_classes=units, prefetch=prefetch,
        reshard_after_forward=reshard_after_forward, offload_params=offload_params,
        gather_timeout=gather_timeout, mesh=mesh, hpz=hpz)


# ZeroAdamW's signature, for checking parallelize's keywords before the model is modified.
_ADAMW_SIGNATURE = inspect.signature(ZeroAdamW)
_HPARAMS = ("lr", "betas", "eps", "weight_decay")


def parallelize(
    model: nn.Module,
    *,
    stage: int = 2,
    params: Iterable[nn.Parameter] | Iterable[dict[str, Any]] | None = None,
    unit_classes: Iterable[type | str] | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
    offload: str | None = None,
    offload_params: bool = False,
    gather_timeout: float | None = None,
    process_group: Any = None,
    mesh: Any = None,
    hpz: bool = False,
    **adamw_kwargs: Any,
) -> ZeroAdamW:
    """Put ``model`` and its ZeroAdamW together for ``stage``; returns the optimizer.

    The one call for every stage: ``shard_for(model, stage=stage, ...)`` (at stage 3 the
    model is partitioned in place by ``shard_model``; at stages 0-2 it is left as it is and
    the stage-3 options are ignored), then ``ZeroAdamW(params, stage=stage,
    offload=offload, process_group=process_group, **adamw_kwargs)``. The result is exactly
    (bitwise) that of those two calls written by hand.

    ```python
    opt = zerokern.parallelize(model, stage=3, unit_classes=(Block,), lr=3e-4,
                               weight_decay=0.1, max_grad_norm=1.0)
    # or every option in one object, the one the trainer integrations take too:
    cfg = zerokern.ZeroConfig(stage=3, unit_classes=(Block,), max_grad_norm=1.0)
    opt = zerokern.parallelize(model, config=cfg, lr=3e-4, weight_decay=0.1)
    ```

    Args:
        model: the model, already on its device and in its dtype, not wrapped in DDP.
        stage: the ZeRO stage (0-3).
        params: what the optimizer trains: parameters or param-group dicts, as for
            ``torch.optim.AdamW``; default ``model.parameters()``.
        unit_classes: stage 3: the module classes (or class names) that become units;
            default the model's ``_no_split_modules``, else ``shard_model``'s choice.
        prefetch: stage 3: how many units are gathered ahead.
        reshard_after_forward: stage 3: release each unit after its forward.
        offload: ``"cpu"``: ZeRO-Offload (stages 1-3), the optimizer state and step in host
            memory.
        offload_params: stage 3 only, with ``offload="cpu"``: the parameter shards in host
            memory too.
        gather_timeout: stage 3: the longest wait, in seconds, in one unit's collective.
        process_group: the group whose ranks share the work; default the world.
        mesh: instead of ``process_group``, a 1-D or 2-D DeviceMesh: hybrid sharding (dim 0
            replicate, dim 1 shard), given to ``shard_model`` at stage 3 and to ZeroAdamW
            at stages 0-2 (docs/hybrid.md).
        hpz: stage 3 with a 2-D ``mesh``: ZeRO++'s hpZ, the model sharded over every rank
            with an in-node copy of the parameters for the backward's gathers
            (``shard_model(hpz=True)``).
        **adamw_kwargs: the rest of ZeroAdamW's arguments (``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``bucket_numel``, ``max_grad_norm``, ``loss_scale``,
            ``overlap_comm``, ``backend``, ``moments``, ``master``, ``seed``, ...), or every
            option (the stage-3 ones above included) as ``config=zerokern.ZeroConfig(...)``;
            an option given both ways is refused.

    Returns:
        The ZeroAdamW (the model is the one given, partitioned in place at stage 3).

    Raises:
        ValueError: a stage that is not an int 0-3; ``offload`` other than None or
            ``"cpu"``, or at stage 0; ``offload_params`` at stages 0-2 or without
            ``offload="cpu"``; a bad ``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``bucket_numel``, ``max_grad_norm``, ``loss_scale``, ``moments``, ``master``,
            ``seed``, ``reduce_dtype`` or ``backend``; ``master="none"`` with parameters
            that are not bf16; parameters on the meta device; a torch AdamW flag ZeroAdamW
            refuses (``amsgrad``, ``maximize``, ``differentiable``); options that differ
            across ranks (compared in one gather, as ZeroAdamW compares them; a refusal on
            one rank is raised on every rank); what ``shard_model`` refuses (unit classes
            that match no module, a bad ``prefetch``). All of these are checked before the
            model is modified, so the corrected call works on the same model.
        TypeError: a keyword that ZeroAdamW does not take, a ``config`` that is no
            ZeroConfig, or bad ``unit_classes`` entries (before the model is modified).
        RuntimeError: the model is already sharded (``shard_model`` or ``parallelize`` at
            stage 3 called before), as ``shard_model`` refuses it.
    """
    built: dict[str, Any] = {}

    def options() -> tuple[ZeroConfig, list[Any] | None, dict[str, Any]]:
        listed = None if params is None else _listed(params)
        try:
            bound = _ADAMW_SIGNATURE.bind(listed, stage=stage, offload=offload,
                                          process_group=process_group, mesh=mesh,
                                          **adamw_kwargs)
        except TypeError as exc:
            raise TypeError(f"parallelize: {exc} (the keywords after the stage-3 options "
                            "are ZeroAdamW's)") from None
        bound.apply_defaults()
        a = bound.arguments
        given = {n: a[n] for n in ZeroConfig.adamw_names()}
        given.update(unit_classes=unit_classes, prefetch=prefetch,
                     reshard_after_forward=reshard_after_forward,
                     offload_params=offload_params, gather_timeout=gather_timeout, hpz=hpz)
        cfg = ZeroConfig.merge(a["config"], given, "parallelize")
        check_adamw_flags(dict(amsgrad=a["amsgrad"], maximize=a["maximize"],
                               differentiable=a["differentiable"]), "")
        built.update(listed=listed, rest={k: v for k, v in adamw_kwargs.items()
                                          if k not in ZeroConfig.names() and k != "config"})
        return cfg, listed, {k: a[k] for k in _HPARAMS}

    # errors about unit classes name shard_for, as before
    cfg = _prepare(model, options, mesh=mesh, process_group=process_group,
                   where="parallelize", caller="shard_for")
    listed = built["listed"]
    return ZeroAdamW(model.parameters() if listed is None else listed, config=cfg,
                     process_group=process_group, mesh=mesh, **built["rest"])


def prepare_model(
    model: nn.Module,
    config: ZeroConfig,
    *,
    mesh: Any = None,
    process_group: Any = None,
    hparams: Mapping[str, Any] | None = None,
    where: str = "prepare_model",
) -> nn.Module:
    """``parallelize``'s first half with all of its checks, for a trainer that builds the
    optimizer later (the HF Trainer's ``create_optimizer``, Lightning's
    ``configure_optimizers``): what the trainer integrations call.

    Validates ``config``, checks ``hparams`` and the model's parameters as ZeroAdamW will,
    compares the options and the mesh across ranks in one gather (a collective at every
    stage: call it on every rank), and only then, at stage 3, partitions the model by
    ``shard_for`` with ``config``'s stage-3 options. Build the optimizer afterwards with
    ``ZeroAdamW(params, config=config, mesh=mesh, process_group=process_group,
    **hparams)``: the two calls are ``parallelize``.

    Args:
        model: the model, already on its device and in its dtype, not wrapped in DDP.
        config: every option (``ZeroConfig``).
        mesh: a 1-D or 2-D DeviceMesh, as for ``parallelize``.
        process_group: instead of ``mesh``, the group whose ranks share the work.
        hparams: the optimizer's ``lr``, ``betas``, ``eps`` and ``weight_decay`` where they
            are known already (those missing are ZeroAdamW's defaults), checked now; None:
            left to ZeroAdamW.
        where: the caller, named in the errors.

    Returns:
        ``model`` itself (partitioned in place at stage 3).

    Raises:
        ValueError: what ``parallelize`` refuses, on every rank and before the model is
            modified.
        TypeError: a ``config`` that is no ZeroConfig, bad ``unit_classes`` entries, or
            ``hparams`` keys other than the four.
        RuntimeError: the model is already sharded.
    """
    def options() -> tuple[ZeroConfig, None, dict[str, Any] | None]:
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"{where}: config must be a zerokern.ZeroConfig, got "
                            f"{type(config).__name__}")
        if hparams is None:
            return config, None, None
        unknown = sorted(set(hparams) - set(_HPARAMS))
        if unknown:
            raise TypeError(f"{where}: hparams takes {_HPARAMS}, got {unknown[0]!r}")
        return config, None, {k: hparams.get(k, _ADAMW_SIGNATURE.parameters[k].default)
                               for k in _HPARAMS}

    _prepare(model, options, mesh=mesh, process_group=process_group, where=where,
             caller=where)
    return model


def _prepare(model: nn.Module, options: Callable[[], tuple[ZeroConfig, Any, Any]], *,
             mesh: Any, process_group: Any, where: str, caller: str) -> ZeroConfig:
    """Every check first, on every rank, then one gather compares the options and carries
    any rank's refusal to all (zero/agreement.py), then ``shard_for``. ``options()`` (run
    inside the checks, so that its refusals travel too) gives the config, the listed
    params (None: the model's) and the hyperparameters to check (None: none)."""
    # shard_model changes the model, so nothing it would not survive may reach it (a refusal
    # after it would leave the model sharded, and the corrected call refused as "already
    # sharded").
    failure: BaseException | None = None
    cfg: ZeroConfig | None = None
    units: tuple[type, ...] | None = None
    try:
        given, listed, hp = options()
        cfg = given.validate()
        if hp is not None:
            check_hparams(hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"])
            check_eps_moments(hp["eps"], cfg.state_format.moments)
        _check_params(model if listed is None else listed, cfg)
        if cfg.stage == 3:
            units = resolve_units(model, cfg.unit_classes, caller=caller)
    except (ValueError, TypeError, RuntimeError) as exc:
        failure = exc
    agree(agreement_comm(mesh=mesh, process_group=process_group), where,
          options=None if cfg is None else cfg.agreed(), failure=failure,
          mesh=NO_MESH if mesh is None else describe_mesh(mesh, process_group, where))
    assert cfg is not None  # else agree raised
    shard_for(model, stage=cfg.stage, unit_classes=units, prefetch=cfg.prefetch,
              reshard_after_forward=cfg.reshard_after_forward,
              offload_params=cfg.offload_params, gather_timeout=cfg.gather_timeout,
              process_group=process_group, mesh=mesh, hpz=cfg.hpz)
    return cfg


def _listed(params: Any) -> list[Any]:
    """``params`` as a list that can be read twice (the checks, then ZeroAdamW): a generator,
    or a group's generator, would be used up by the first reading."""
    if torch.is_tensor(params) or not isinstance(params, Iterable):
        raise TypeError(f"params must be an iterable of parameters or param-group dicts (as "
                        f"for torch.optim.AdamW), got a {type(params).__name__}")
    out = []
    for item in params:
        if isinstance(item, dict) and "params" in item and not torch.is_tensor(item["params"]):
            item = {**item, "params": list(item["params"])}
        out.append(item)
    return out


def _check_params(source: nn.Module | list[Any], cfg: ZeroConfig) -> None:
    """What ZeroAdamW checks of its parameters, before shard_model changes them: something
    to train, listed once, one dtype and device, not on the meta device, and bf16 for
    ``master="none"``."""
    if isinstance(source, nn.Module):
        groups = [{"params": list(source.parameters())}]
    elif source and all(isinstance(g, dict) for g in source):
        groups = [{"params": _tensors(g.get("params", []))} for g in source]
    else:
        groups = [{"params": _tensors(source)}]
    managed, _ = trained_params(groups)
    dtype, _ = common_dtype_device([p for ps in managed for p in ps])
    check_master_dtype(cfg.state_format, dtype)


def _tensors(ps: Any) -> list[torch.Tensor]:
    """A group's parameters: a tensor, tensors, or (name, tensor) pairs."""
    if torch.is_tensor(ps):
        return [ps]
    out = []
    for x in ps:
        t = x[1] if isinstance(x, tuple) and len(x) == 2 else x
        if not torch.is_tensor(t):
            raise TypeError(f"params: expected parameters, (name, parameter) pairs or "
                            f"param-group dicts, got a {type(t).__name__}")
        out.append(t)
    return out
