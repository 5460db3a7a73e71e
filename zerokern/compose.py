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
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from torch import nn

from .zero import ZeroAdamW, shard_model
from .zero.interchange import check_adamw_flags
from .zero.offload import check_offload_backend
from .zero.scaler import LossScaler
from .zero.validate import (
    check_hparams,
    check_offload,
    check_offload_params,
    check_reduce_dtype,
    check_zero_args,
)

__all__ = ["parallelize", "resolve_units", "shard_for"]


def _check_stage(stage: Any) -> None:
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")


def _check_offload_params_stage(offload_params: Any, stage: int) -> None:
    if offload_params and stage != 3:
        raise ValueError(
            f"offload_params={offload_params!r}: parameter shards in host memory are stage 3's "
            f"(shard_model partitions the parameters); pass stage=3, or leave offload_params "
            f"False (got stage={stage})")


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
    _check_offload_params_stage(offload_params, stage)
    if stage != 3:
        return model
    units = resolve_units(model, unit_classes)
    return shard_model(
        model, process_group=process_group, unit_classes=units, prefetch=prefetch,
        reshard_after_forward=reshard_after_forward, offload_params=offload_params,
        gather_timeout=gather_timeout, mesh=mesh)


# ZeroAdamW's signature, for checking parallelize's keywords before the model is modified.
_ADAMW_SIGNATURE = inspect.signature(ZeroAdamW)


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
        **adamw_kwargs: the rest of ZeroAdamW's arguments (``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``bucket_numel``, ``max_grad_norm``, ``loss_scale``,
            ``overlap_comm``, ``backend``, ...).

    Returns:
        The ZeroAdamW (the model is the one given, partitioned in place at stage 3).

    Raises:
        ValueError: a stage outside 0-3; ``offload`` other than None or ``"cpu"``, or at
            stage 0; ``offload_params`` at stages 0-2 or without ``offload="cpu"``;
            ``backend="cuda"`` or ``"triton"`` with ``offload`` (the step runs on the host); a
            bad ``lr``, ``betas``, ``eps``, ``weight_decay``, ``bucket_numel``,
            ``max_grad_norm`` or ``loss_scale``; a torch AdamW flag ZeroAdamW refuses
            (``amsgrad``, ``maximize``, ``differentiable``); what ``shard_model`` refuses
            (unit classes that match no module, a bad ``prefetch``). All of these are
            checked before the model is modified.
        TypeError: a keyword that ZeroAdamW does not take, or bad ``unit_classes``
            entries (before the model is modified).
        RuntimeError: the model is already sharded (``shard_model`` or ``parallelize`` at
            stage 3 called before), as ``shard_model`` refuses it.
    """
    _check_stage(stage)
    check_offload(offload, stage)
    _check_offload_params_stage(offload_params, stage)
    # The optimizer's own rule, checked here before shard_model changes the model.
    check_offload_params(SimpleNamespace(offload_params=offload_params), offload)
    try:
        bound = _ADAMW_SIGNATURE.bind(params, stage=stage, offload=offload,
                                      process_group=process_group, mesh=mesh, **adamw_kwargs)
    except TypeError as exc:
        raise TypeError(f"parallelize: {exc} (the keywords after the stage-3 options are "
                        "ZeroAdamW's)") from None
    bound.apply_defaults()
    a = bound.arguments
    check_hparams(a["lr"], a["betas"], a["eps"], a["weight_decay"])
    # ZeroAdamW's own checks, run here too so that nothing it would refuse reaches
    # shard_model (which changes the model).
    check_zero_args(stage, offload, a["bucket_numel"], a["max_grad_norm"])
    check_adamw_flags(dict(amsgrad=a["amsgrad"], maximize=a["maximize"],
                           differentiable=a["differentiable"]), "")
    LossScaler.from_arg(a["loss_scale"])
    check_reduce_dtype(a["reduce_dtype"], offload)
    check_offload_backend(a["backend"], offload)
    shard_for(model, stage=stage, unit_classes=unit_classes, prefetch=prefetch,
              reshard_after_forward=reshard_after_forward, offload_params=offload_params,
              gather_timeout=gather_timeout, process_group=process_group, mesh=mesh)
    return ZeroAdamW(model.parameters() if params is None else params, stage=stage,
                     offload=offload, process_group=process_group, mesh=mesh, **adamw_kwargs)
