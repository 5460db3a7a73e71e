"""One engine per ZeRO stage (see base.py for the verbs they share; stage 3's optimizer side
is stage3/engine.py, beside the units it steps). Each composes this
rank's optimizer state (shard_state.py), placed on the device or, with ZeRO-Offload, on the
host; the stage owns only how gradients are reduced and how parameters come back.

``make_engine`` and ``planned_memory`` are the only entry points the optimizer uses.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layout import Layout
from ..rules import UpdateRule
from ..stage3.engine import Stage3
from ..state_format import StateFormat, plan_runs
from .accounting import planned_flat_memory
from .base import Engine, Run
from .flat import FlatEngine
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2

ENGINES: dict[int, type[Engine]] = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}


def make_engine(stage: int, offload: str | None, layout: Layout,
                params: list[torch.nn.Parameter], comm: Any, *, dtype: torch.dtype,
                device: torch.device, overlap: bool, backend: str | None,
                runtime: Any = None, fmt: StateFormat | None = None, seed: int = 0,
                param_numels: list[int] | None = None,
                grad_dtype: torch.dtype | None = None, rule: UpdateRule | None = None) -> Engine:
    """The engine of ``stage`` with its state on the device (``offload`` None) or on the host
    (``"cpu"``), allocated for ``layout``; ``runtime``: stage 3's shard_model runtime;
    ``fmt``: how the state is stored (``seed``: its stochastic rounding key);
    ``param_numels``: the parameters' full sizes (stage 3's are released); ``grad_dtype``:
    the dtype gradients are reduced in (None: the parameters'); ``rule``: the update rule
    (None: AdamW)."""
    extra = {"runtime": runtime} if stage == 3 else {}
    return ENGINES[stage](layout, params, comm, dtype=dtype, device=device, overlap=overlap,
                          backend=backend, offload=bool(offload), fmt=fmt, seed=seed,
                          param_numels=param_numels, grad_dtype=grad_dtype, rule=rule, **extra)


def planned_memory(stage: int, offload: str | None, layout: Layout,
                   dtype: torch.dtype, fmt: StateFormat | None = None,
                   param_numels: list[int] | None = None,
                   grad_dtype: torch.dtype | None = None,
                   rule: UpdateRule | None = None) -> dict[str, int]:
    """memory_stats() of stages 0-2 before the first step: the blocks the engine will take
    (nothing is allocated)."""
    cls = ENGINES[stage]
    assert issubclass(cls, FlatEngine)
    side = 0
    if fmt is not None and not fmt.is_default and param_numels is not None:
        side = plan_runs(layout.pieces, param_numels, fmt).side_numel
    specs = cls.device_specs(layout, dtype, bool(offload), fmt, side, grad_dtype, rule)
    return planned_flat_memory(layout, dtype, specs,
                               cls.host_specs(layout, dtype, fmt, side, rule) if offload
                               else None, rule)


__all__ = ["ENGINES", "Engine", "Run", "Stage0", "Stage1", "Stage2", "Stage3", "make_engine",
           "planned_memory"]
