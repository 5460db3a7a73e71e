"""``torch.optim.Muon`` as an update rule: the state and checks of a torch class (its
``momentum_buffer``, flat and sharded to the element like any torch class's buffer), stepped
by whole-matrix owners instead of range by range (zero/muon_step.py).

Muon's update of a matrix is element-wise except for one part: the Newton-Schulz
orthogonalization of the (Nesterov) momentum, which reads the whole matrix. So the momentum
lives where every other buffer lives (this rank's flat shard: state dicts, ``opt.state``,
checkpoints and resharding carry it unchanged), each rank advances its own elements of it,
and only the orthogonalization goes to the matrix's owner (zerokern.optim.muon_plan).

What differs from ``TorchClassRule``: the probe is a matrix (Muon refuses anything else),
every trained parameter must be 2-D (torch's own error, raised by ``torch.optim.Muon`` built
over the parameters' full shapes, at construction, before anything is sharded), and the
state formats are fp32 only. (What torch's Newton-Schulz refuses only inside its step,
``ns_steps >= 100``, the probe's one step raises at construction, and at any step whose
group was changed so, before anything changes.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..registry import runtime_of_param
from ..state_format import StateFormat
from .torch_class import TorchClassRule


class MuonRule(TorchClassRule):
    """``torch.optim.Muon`` (or a subclass keeping its ``step``) under ZeroOptimizer."""

    probe_shape = (1, 3)

    def __init__(self, cls: type[torch.optim.Optimizer], defaults: Mapping[str, Any],
                 given: Mapping[str, Any] | None = None) -> None:
        super().__init__(cls, defaults, given)
        self._checked: set[int] = set()  # ids of the parameters found 2-D already

    def declare(self, groups: list[Mapping[str, Any]]) -> None:
        for gi, g in enumerate(groups):
            self.check_params(g, f" (param group {gi})")
        super().declare(groups)

    def check_params(self, group: Mapping[str, Any], where: str = "") -> None:
        """torch.optim.Muon's refusal of a parameter that is not 2-D, in its words: Muon
        built over placeholders of the parameters' full shapes (stage 3's parameters are
        released placeholders; their runtime knows the shapes) with the group's values."""
        params = [p for p in _params(group) if id(p) not in self._checked]
        if not params:
            return
        fake = []
        for p in params:
            rt = runtime_of_param(p)
            shape = rt.shape_of(p) if rt is not None else p.shape
            fake.append(torch.nn.Parameter(torch.empty(shape, device="meta")))
        try:
            self.torch_class(fake, **{**self.given, **self.hparams(group)})
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{self.label}{where}: {exc}") from None
        self._checked.update(id(p) for p in params)

    def check_hparams(self, group: Mapping[str, Any], where: str = "",
                      fmt: StateFormat | None = None) -> None:
        self.check_params(group, where)  # add_param_group's new parameters
        super().check_hparams(group, where, fmt)

    def __repr__(self) -> str:
        return f"MuonRule({self.label})"


def _params(group: Mapping[str, Any]) -> Iterable[Any]:
    ps = group.get("params", ())
    return [ps] if isinstance(ps, torch.Tensor) else list(ps)


def is_muon(cls: type) -> bool:
    """Whether ``cls`` runs ``torch.optim.Muon``'s own ``step`` (Muon or a subclass keeping
    it)."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None or not issubclass(cls, muon):
        return False
    owner = next((c for c in cls.__mro__ if "step" in c.__dict__), None)
    return owner is muon
