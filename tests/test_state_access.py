"""The state seen from outside (zerokern/zero/optimizer_state.py: opt.state, shards, the
per-rank state dict; interchange.py: torch.optim.AdamW's format) in one process at world size
1. With ``backend="torch"`` ZeroAdamW's step is torch.optim.AdamW(foreach=False)'s, so every
value is compared exactly."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import zerokern

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4))


def _train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(5, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_state_and_full_state_dict_are_torchs(stage):
    base = _model()
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = zerokern.ZeroAdamW(ours.parameters(), stage=stage, bucket_numel=64, backend="torch",
                             **HP)
    ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    _train(ours, opt, 3)
    _train(ref, ropt, 3)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        st, rst = opt.state[p], ropt.state[q]
        assert st["step"].item() == rst["step"].item()
        assert torch.equal(st["exp_avg"], rst["exp_avg"].reshape(-1))
        assert torch.equal(st["exp_avg_sq"], rst["exp_avg_sq"].reshape(-1))
    full, rsd = opt.full_state_dict(), ropt.state_dict()
    # torch's group keys with AdamW's defaults (the reference asked for foreach=False).
    assert full["param_groups"] == [{**g, "foreach": None} for g in rsd["param_groups"]]
    for i, rst in rsd["state"].items():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(full["state"][i][k], rst[k])


@pytest.mark.parametrize("stage", [0, 2])
def test_torch_state_loads_and_trains_on_as_torch(stage):
    base = _model()
    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    _train(ref, ropt, 2)
    ours = copy.deepcopy(ref)
    opt = zerokern.ZeroAdamW(ours.parameters(), stage=stage, backend="torch", **HP)
    opt.load_state_dict(ropt.state_dict())
    _train(ours, opt, 2, seed=5)
    _train(ref, ropt, 2, seed=5)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_per_rank_state_dict_resumes_exactly(stage):
    base = _model()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa = zerokern.ZeroAdamW(a.parameters(), stage=stage, backend="torch", **HP)
    ob = zerokern.ZeroAdamW(b.parameters(), stage=stage, backend="torch", **HP)
    assert oa.state_dict()["state"] == {} and oa.layout is None  # nothing fixed by asking
    _train(a, oa, 2)
    b.load_state_dict(a.state_dict())
    ob.load_state_dict(oa.state_dict())
    assert ob.shards_step(0) == 2
    _train(a, oa, 2, seed=3)
    _train(b, ob, 2, seed=3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_edit_shards_writes_the_state():
    model = _model()
    opt = zerokern.ZeroAdamW(model.parameters(), stage=1, backend="torch", **HP)
    _train(model, opt, 1)
    with opt.edit_shards(model) as shards:
        for sh in shards:
            sh.step = 7
            for r in sh.ranges:
                r.exp_avg.fill_(0.25)
    p = next(model.parameters())
    assert opt.state[p]["step"].item() == 7 and opt.shards_step(0) == 7
    assert torch.equal(opt.state[p]["exp_avg"], torch.full((p.numel(),), 0.25))
    assert opt.shards(model)[0].name == "0.weight"


def test_copies_of_the_state_are_snapshots():
    model = _model()
    opt = zerokern.ZeroAdamW(model.parameters(), stage=2, backend="torch", **HP)
    _train(model, opt, 1)
    first = next(iter(opt.state))
    before = opt.state[first]["exp_avg"].clone()
    snap = copy.deepcopy(opt.state)
    assert type(snap) is dict and len(snap) == len(opt.state)
    assert type(next(iter(snap.values()))) is dict
    _train(model, opt, 1)
    assert not torch.equal(opt.state[first]["exp_avg"], before)
    assert torch.equal(next(iter(snap.values()))["exp_avg"], before)  # apart from the optimizer
    # The optimizer pickles (torch.optim.Optimizer.__getstate__ takes opt.state along); the
    # copy has no parts, so its state reads empty.
    assert pickle.loads(pickle.dumps(opt)).state == {}
    torch.save(opt, io.BytesIO())
    assert copy.deepcopy(opt).state == {}


def _refused_unchanged(model, opt, sd, match):
    """Loading ``sd`` raises ``match``; the model and the optimizer's state are untouched."""
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    with pytest.raises((ValueError, TypeError), match=match):
        opt.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    after = opt.state_dict()
    for k in ("exp_avg", "exp_avg_sq", "steps"):
        assert torch.equal(after["state"][k], state["state"][k]), k


@pytest.mark.parametrize("bad", ["extra key", "steps a str", "steps float", "steps negative"])
def test_bad_per_rank_state_dict_is_refused_naming_the_key(bad):
    """A per-rank state dict (zerokern's own format) with an unknown top-level key or step
    counts that are not non-negative integers: refused, naming the key, nothing changed
    (issue 35's adversarial pass; before, an extra key was ignored and "steps" failed inside
    .tolist())."""
    model = _model()
    opt = zerokern.ZeroAdamW(model.parameters(), stage=1, **HP)
    _train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    if bad == "extra key":
        sd["bogus"] = 1
        match = "unknown top-level key 'bogus'"
    else:
        n = sd["state"]["steps"].numel()
        sd["state"]["steps"] = {"steps a str": "three",
                                "steps float": torch.full((n,), 2.0),
                                "steps negative": torch.full((n,), -1)}[bad]
        match = "'steps'"
    _refused_unchanged(model, opt, sd, match)


@pytest.mark.parametrize("bad", ["step a str", "NaN exp_avg_sq", "negative exp_avg_sq",
                                 "inf exp_avg"])
def test_bad_torch_state_dict_is_refused_naming_the_key(bad):
    """A torch-format state dict whose step is not a number, or whose moments hold a NaN, an
    infinity or a negative second moment (every later update of that parameter would be NaN):
    refused naming the key and the parameter, nothing changed."""
    model = _model()
    opt = zerokern.ZeroAdamW(model.parameters(), stage=1, **HP)
    _train(model, opt, 2)
    sd = copy.deepcopy(opt.full_state_dict(rank0_only=False))
    st = sd["state"][1]
    if bad == "step a str":
        st["step"] = "two"
        match = "step of parameter 1 must be a number"
    elif bad == "NaN exp_avg_sq":
        st["exp_avg_sq"][0] = float("nan")
        match = "exp_avg_sq of parameter 1 holds a NaN"
    elif bad == "negative exp_avg_sq":
        st["exp_avg_sq"][0] = -1.0
        match = "exp_avg_sq of parameter 1 holds negative values"
    else:
        st["exp_avg"][-1] = float("inf")
        match = "exp_avg of parameter 1 holds a NaN or an infinity"
    _refused_unchanged(model, opt, sd, match)


def test_missing_parameter_state_starts_afresh_as_torch():
    """A torch-format state dict without one parameter's state (torch keeps none for a
    parameter that never had a gradient): that parameter starts afresh, as torch's AdamW
    loading the same dict has it, and both then train alike."""
    model, ref = _model(), _model()
    opt = zerokern.ZeroAdamW(model.parameters(), stage=1, backend="torch", **HP)
    ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    _train(model, opt, 2)
    _train(ref, ropt, 2)
    sd = copy.deepcopy(opt.full_state_dict(rank0_only=False))
    del sd["state"][2]
    opt.load_state_dict(copy.deepcopy(sd))
    ropt.load_state_dict(copy.deepcopy(sd))
    _train(model, opt, 2, seed=2)
    _train(ref, ropt, 2, seed=2)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_process_group_that_is_not_a_group_is_refused():
    """``process_group=5`` (a rank, not a group): refused naming the argument, instead of
    torch's "Group 5 is not registered" from deep inside the first collective."""
    from fake_pg import fake_group

    with fake_group(0, 2):
        model = _model()
        with pytest.raises(TypeError, match="process_group must be a torch.distributed "
                                            "ProcessGroup.*got int"):
            zerokern.ZeroAdamW(model.parameters(), stage=1, process_group=5, **HP)
