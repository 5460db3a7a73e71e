"""Item 3's porting promise, as a script writes it: Muon for the hidden matrices and AdamW for
the rest, the script's own learning-rate and momentum schedules written into ``param_groups``
every step, and its own checkpoint code (``model.state_dict()`` and each optimizer's
``state_dict()`` saved at one step, loaded by a fresh process's model and optimizers). The
same function runs torch's optimizers with DDP-style averaging and zerokern's at stages 2 and
3 (built by ``zerokern.ZeroOptimizer`` instead of the torch class: the only line that
changes); the resumed zerokern run must match the uninterrupted torch run to
tests/test_zero_muon.py's derived tolerance, taken over this run's 6 steps."""

from __future__ import annotations

import copy
import math

import torch
from _tol import U_BF16
from dist_utils import run_ranks
from test_zero_muon import ADAMW, LR, MUON, MuonNet, _split
from test_zero_optimizer import TOL
from test_zero_parity import _ref_average

import zerokern

STEPS, SAVE_AT = 6, 3
MATRICES = ("l1.weight", "l2.weight", "l3.weight", "big.weight", "head.weight")
# test_zero_muon's bound with this run's step count (its schedules only lower the rates).
MUON_TOL = STEPS * LR * math.sqrt(40 / 12) * 8 * 1.2 * U_BF16


def _schedules(muon, adamw, step: int) -> None:
    """The script's own schedules: momentum warm-up for Muon, linear decay for both."""
    decay = 1 - step / (2 * STEPS)
    for g in muon.param_groups:
        g["momentum"] = 0.85 + 0.1 * min(step / 3, 1.0)
        g["lr"] = LR * decay
    for g in adamw.param_groups:
        g["lr"] = ADAMW["lr"] * decay


def _script(base, make, rank, world, average, steps, start=0, ckpt=None):
    """One 'process' of the script: builds its model and optimizers, resumes from ``ckpt``
    if given, trains ``steps`` steps, returns its model and a checkpoint of where it is."""
    model, muon, adamw = make(copy.deepcopy(base))
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        muon.load_state_dict(ckpt["muon"])
        adamw.load_state_dict(ckpt["adamw"])
    for step in range(start, start + steps):
        _schedules(muon, adamw, step)
        model(step, rank).backward()
        if average:
            _ref_average(model, world)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    saved = {"model": copy.deepcopy(model.state_dict()),
             "muon": copy.deepcopy(muon.state_dict()),
             "adamw": copy.deepcopy(adamw.state_dict())}
    return model, saved


def _torch(model):
    muon, rest = _split(model, MATRICES)
    return model, torch.optim.Muon(muon, **MUON), torch.optim.AdamW(rest, **ADAMW)


def _zero(stage):
    def make(model):
        if stage == 3:
            model = zerokern.shard_model(model)
        muon, rest = _split(model, MATRICES)
        return (model, zerokern.ZeroOptimizer(muon, torch.optim.Muon, stage=stage, **MUON),
                zerokern.ZeroOptimizer(rest, torch.optim.AdamW, stage=stage, **ADAMW))
    return make


def script_case(rank, world):
    torch.manual_seed(0)
    base = MuonNet()
    ref, _ = _script(base, _torch, rank, world, True, STEPS)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    for stage in (2, 3):
        _, ck = _script(base, _zero(stage), rank, world, False, SAVE_AT)
        model, _ = _script(base, _zero(stage), rank, world, False, STEPS - SAVE_AT,
                           start=SAVE_AT, ckpt=ck)
        got = model.state_dict()  # stage 3: the full tensors (a collective)
        for name, w in want.items():
            tol = MUON_TOL if name in MATRICES else TOL
            torch.testing.assert_close(got[name].detach(), w, rtol=0 if name in MATRICES
                                       else tol, atol=tol,
                                       msg=lambda m, s=stage, n=name: f"stage {s} {n}: {m}")


def test_a_muon_script_ports_by_its_optimizer_lines(tmp_path):
    run_ranks(2, script_case, tmp_path=tmp_path)
