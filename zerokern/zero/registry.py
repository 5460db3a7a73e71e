"""Where a stage-3 runtime is found: weak maps from a sharded model and from each of its
parameters to the Stage3Runtime that partitions them (no attributes planted on user objects;
an entry goes when its model or parameter is collected)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from .stage3 import Stage3Runtime

_BY_MODULE: WeakIdKeyDictionary = WeakIdKeyDictionary()
_BY_PARAM: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(model: nn.Module, params: Iterable[nn.Parameter], rt: Stage3Runtime) -> None:
    _BY_MODULE[model] = rt
    register_params(params, rt)


def register_params(params: Iterable[nn.Parameter], rt: Stage3Runtime) -> None:
    """``params`` are partitioned by ``rt`` (a model of several dtypes: one runtime each)."""
    for p in params:
        _BY_PARAM[p] = rt


def runtime_of_module(model: object) -> Stage3Runtime | None:
    """The runtime of a model that ``shard_model`` partitioned (None for any other object)."""
    if not isinstance(model, nn.Module):
        return None
    return _BY_MODULE.get(model)


def runtime_of_param(p: object) -> Stage3Runtime | None:
    """The runtime that owns parameter ``p`` (None when ``p`` is not sharded)."""
    if not isinstance(p, nn.Parameter):
        return None
    return _BY_PARAM.get(p)
