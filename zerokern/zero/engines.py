"""The registry of stage engines: stage number -> engine class, and the two entry points the
optimizer side uses (engine_slot.py). It lives beside, not inside, the packages it lists:
``stages/`` (stages 0-2) and ``stage3/`` (whose engine builds on ``stages/base.py``) then
import in one direction only, stage3 -> stages, and nothing in ``stages/`` names stage 3.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.quantized_parts import WireFormat
from .layout import Layout
from .rules import UpdateRule
from .stage3.engine import Stage3
from .stages import Engine, FlatEngine, Stage0, Stage1, Stage2
from .stages.accounting import planned_flat_memory
from .state_format import StateFormat, plan_runs

ENGINES: dict[int, type[Engine]] = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}


def make_engine(stage: int, offload: str | None, layout: Layout,
                params: list[torch.nn.Parameter], comm: Any, *, dtype: torch.dtype,
                device: torch.device, overlap: bool, backend: str | None,
                runtime: Any = None, fmt: StateFormat | None = None, seed: int = 0,
                param_numels: list[int] | None = None,
                grad_dtype: torch.dtype | None = None, rule: UpdateRule | None = None,
                wire: WireFormat | None = None) -> Engine:
    """The engine of ``stage`` with its state on the device (``offload`` None) or on the host
    (``"cpu"``), allocated for ``layout``; ``runtime``: stage 3's shard_model runtime;
    ``fmt``: how the state is stored (``seed``: its stochastic rounding key);
    ``param_numels``: the parameters' full sizes (stage 3's are released); ``grad_dtype``:
    the dtype gradients are reduced in (None: the parameters'); ``rule``: the update rule
    (None: AdamW); ``wire``: what stages 0-2's communication parts quantize (stage 3's are
    the runtime's: ``Stage3Runtime.set_comm``)."""
    extra: dict[str, Any] = {"runtime": runtime} if stage == 3 else {"wire": wire}
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
