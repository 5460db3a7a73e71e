"""Loss scaling for fp16 training: static, or dynamic as DeepSpeed and torch.amp do it
(start at 2^16, halve on a non-finite gradient, double after `growth_interval` good steps)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    good_steps: int = 0
    skipped_steps: int = 0

    @classmethod
    def from_arg(cls, loss_scale: float | str | None) -> LossScaler | None:
        if loss_scale is None:
            return None
        if loss_scale == "dynamic":
            return cls(scale=2.0**16, dynamic=True)
        if isinstance(loss_scale, str) or isinstance(loss_scale, bool):
            raise ValueError(f"loss_scale must be None, 'dynamic' or a positive float, "
                             f"got {loss_scale!r}")
        v = float(loss_scale)
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"loss_scale must be a positive finite float, got {loss_scale!r}")
        return cls(scale=v, dynamic=False)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.skipped_steps += 1
            self.good_steps = 0
            if self.dynamic:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.good_steps += 1
        if self.dynamic and self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
