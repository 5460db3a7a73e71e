"""Optimizers' update rules that are independent of the ZeRO engines.

Muon with whole-matrix owners: the plan (:mod:`zerokern.optim.muon_plan`: which rank owns
which matrix, balanced by Newton-Schulz cost), the update of an owned matrix
(:mod:`zerokern.optim.muon`: bit for bit ``torch.optim.Muon``'s), and a reference distributed
Muon built on them (:mod:`zerokern.optim.owner_muon`); the exchange itself is
:mod:`zerokern.comm.owner_exchange`.
"""

from .muon import (
    adjust_lr,
    check_muon_params,
    muon_update_,
    muon_update_batched_,
    newton_schulz,
)
from .muon_plan import Batch, MuonPlan, Unit, ns_cost, plan_muon
from .owner_muon import OwnerMuon

__all__ = ["Batch", "MuonPlan", "OwnerMuon", "Unit", "adjust_lr", "check_muon_params",
           "muon_update_", "muon_update_batched_", "newton_schulz", "ns_cost", "plan_muon"]
