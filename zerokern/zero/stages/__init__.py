"""One engine per ZeRO stage (see base.py for the verbs they share), and the ZeRO-Offload
variants of stages 1-3 (offload_flat.py, offload3.py).

``make_engine`` and ``planned_memory`` are the only entry points the optimizer uses: which
class (or composition) serves a stage and a placement is this package's business.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layout import Layout
from .base import Engine, Run
from .flat import planned_flat_memory
from .offload3 import Stage3Offload
from .offload_flat import Stage1Offload, Stage2Offload
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3 import Stage3

ENGINES: dict[int, type[Engine]] = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}
OFFLOAD_ENGINES: dict[int, type[Engine]] = {1: Stage1Offload, 2: Stage2Offload,
                                            3: Stage3Offload}


def make_engine(stage: int, offload: str | None, layout: Layout,
                params: list[torch.nn.Parameter], comm: Any, *, dtype: torch.dtype,
                device: torch.device, overlap: bool, backend: str | None,
                runtime: Any = None) -> Engine:
    """The engine of ``stage`` with its state on the device (``offload`` None) or on the host
    (``"cpu"``), allocated for ``layout``; ``runtime``: stage 3's shard_model runtime."""
    cls = (OFFLOAD_ENGINES if offload else ENGINES)[stage]
    extra = {"runtime": runtime} if stage == 3 else {}
    return cls(layout, params, comm, dtype=dtype, device=device, overlap=overlap,
               backend=backend, **extra)


def planned_memory(stage: int, offload: str | None, layout: Layout,
                   dtype: torch.dtype) -> dict[str, int]:
    """memory_stats() of stages 0-2 before the first step: the buffers the engine will take
    (nothing is allocated)."""
    cls = (OFFLOAD_ENGINES if offload else ENGINES)[stage]
    if offload:
        return cls.planned_memory(layout, dtype)  # type: ignore[attr-defined]
    return planned_flat_memory(layout, dtype, cls.buffer_specs(layout, dtype))


__all__ = ["ENGINES", "OFFLOAD_ENGINES", "Engine", "Run", "Stage0", "Stage1", "Stage1Offload",
           "Stage2", "Stage2Offload", "Stage3", "Stage3Offload", "make_engine",
           "planned_memory"]
