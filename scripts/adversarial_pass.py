"""Adversarial pass over ZeroAdamW (issue 35, "Show it"): options that differ by rank, edits
of p.grad between backward and step, state dicts in and out of each format, bad inputs.

Every case runs on 2 gloo ranks (a pool of long-lived ranks from tests/dist_utils.py, with a
timeout: a hang or a dead rank is reported as a crash, never hangs this script) and compares
ZeroAdamW with DDP-style averaging + torch.optim.AdamW computed in the same processes, or
checks that an error names its cause and left the model unchanged. Verdicts:

- ok: same result as the reference (tests/_tol.py's TRAIN_FP32 for fp32, a bf16 ulp bound
  for bf16, bit for bit for resumed-vs-uninterrupted), or a clear refusal that names the
  argument on every rank with nothing modified;
- silent: a different result (or a modification before a refusal) with no word;
- crash: a rank died or hung;
- unclear: an error that does not name the cause.

Usage: PYTHONPATH=$PWD python scripts/adversarial_pass.py [-k substring] [-v]
"""

from __future__ import annotations

import copy
import math
import pickle
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import zerokern  # noqa: E402

TRAIN = (1e-5, 1e-5)
CASE_TIMEOUT = 60.0


class Silent(Exception):
    pass


class Unclear(Exception):
    pass


# -- the model, data and reference ------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x) + self.frozen.sum()))


def data(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)


def base_model(dtype=torch.float32):
    torch.manual_seed(0)
    return Net().to(dtype)


def ours_model(base, stage):
    m = copy.deepcopy(base)
    if stage == 3:
        m = zerokern.shard_model(m, unit_classes=(nn.Linear,))
    return m


def full(model, stage):
    if stage == 3:
        return {k: v.float() for k, v in zerokern.full_state_dict(model, rank0_only=False).items()}
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def average(params, world):
    params = [p for p in params if p.requires_grad]
    flags = torch.tensor([0.0 if p.grad is None else 1.0 for p in params])
    dist.all_reduce(flags)
    for p, f in zip(params, flags.tolist()):
        if f == 0:
            p.grad = None
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world)


def close(a, b, dtype, what):
    for k in b:
        x, y = a[k], b[k]
        if dtype == torch.float32:
            ok = torch.allclose(x, y, rtol=TRAIN[0], atol=TRAIN[1])
        else:
            ok = bool(((x - y).abs() <= y.abs() * 2**-7 + 1e-6).all())
        if not ok or not torch.isfinite(x).all() == torch.isfinite(y).all():
            raise Silent(f"{what}: {k} differs by {(x - y).abs().max().item():.3g}")


def replicas_agree(state, what):
    for k, v in state.items():
        other = [torch.zeros_like(v) for _ in range(dist.get_world_size())]
        dist.all_gather(other, v.contiguous())
        if any(not torch.equal(o, other[0]) for o in other):
            raise Silent(f"{what}: replicas of {k} differ across ranks")


def named(exc, words):
    msg = f"{type(exc).__name__}: {exc}"
    if not words or any(w.lower() in msg.lower() for w in words):
        return
    raise Unclear(msg[:300])


def unchanged(model, stage, before, what):
    after = full(model, stage)
    for k in before:
        if not torch.equal(before[k], after[k]):
            raise Silent(f"{what}: {k} modified before the refusal")


def train(rank, world, *, stage=2, dtype=torch.float32, kw=None, groups=None, steps=3,
          edit=None, words=(), accum=1, ref_kw=None, frozen_in_opt=False, after=None,
          must_refuse=False):
    """Train ZeroAdamW and the reference side by side; ``edit(params, ref_params, rank,
    step)`` edits ``p.grad`` of both after the (ref: averaged) backward. A raise from
    ZeroAdamW is accepted when it names one of ``words`` and nothing moved."""
    kw = dict(kw or {})
    base = base_model(dtype)
    ours = ours_model(base, stage)
    ref = copy.deepcopy(base)
    masters = {p: p.detach().float().clone().requires_grad_(p.requires_grad)
               for p in ref.parameters()}
    hp = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    hp.update(ref_kw or {})
    params = list(ours.parameters()) if frozen_in_opt else [p for p in ours.parameters()]
    mk = groups(ours) if groups else params
    before = full(ours, stage)
    try:
        opt = zerokern.ZeroAdamW(mk, stage=stage, **{**hp, **kw})
    except Exception as exc:  # noqa: BLE001
        named(exc, words)
        unchanged(ours, stage, before, "construction")
        return
    rgroups = groups(ref) if groups else list(ref.parameters())
    rgroups = ([dict(g, params=[masters[p] for p in g["params"]]) for g in rgroups]
               if isinstance(rgroups[0], dict) else [masters[p] for p in rgroups])
    ropt = torch.optim.AdamW(rgroups, foreach=False, **hp)
    for step in range(steps):
        for mb in range(accum):
            x, y = data(step * accum + mb, rank)
            x = x.to(dtype)
            ctx = opt.no_sync() if mb < accum - 1 else _Null()
            with ctx:
                F.cross_entropy(ours(x).float(), y).backward()
            F.cross_entropy(ref(x).float(), y).backward()
        average(ref.parameters(), world)
        for p, m in masters.items():
            m.grad = None if p.grad is None else p.grad.float()
        before = full(ours, stage)
        try:
            if edit is not None:
                edit(list(ours.parameters()), list(masters.values()), rank, step, opt)
            opt.step()
        except Exception as exc:  # noqa: BLE001
            named(exc, words)
            unchanged(ours, stage, before, f"step {step}")
            return
        if must_refuse:
            raise Silent(f"step {step}: accepted (expected a refusal)")
        ropt.step()
        with torch.no_grad():
            for p, m in masters.items():
                p.copy_(m)
        opt.zero_grad()
        ropt.zero_grad()
        ref.zero_grad(set_to_none=True)
        got = full(ours, stage)
        close(got, {k: v.float() for k, v in ref.state_dict().items()}, dtype, f"step {step}")
        replicas_agree(got, f"step {step}")
    if after is not None:
        after(ours, opt, stage)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


# -- family 1: options per rank ---------------------------------------------------------------
def per_rank_option(name, v0, v1, stage=2, dtype=torch.float32, agreeable=False):
    def fn(rank, world):
        v = v0 if rank == 0 else v1
        words = (name,) if not agreeable else ()
        if name in ("lr", "betas", "eps", "weight_decay"):
            train(rank, world, stage=stage, dtype=dtype, ref_kw={name: v}, words=words,
                  must_refuse=not agreeable)
        else:
            train(rank, world, stage=stage, dtype=dtype, kw={name: v}, words=words,
                  must_refuse=not agreeable)
    return fn


def per_rank_groups(rank, world):
    def groups(m):
        ps = list(m.parameters())
        ps = [p for p in ps if p.requires_grad]
        return [dict(params=ps[:2], lr=1e-2 if rank == 0 else 2e-2), dict(params=ps[2:])]
    train(rank, world, groups=groups, words=("lr",), must_refuse=True)


def per_rank_group_split(rank, world):
    def groups(m):
        ps = [p for p in m.parameters() if p.requires_grad]
        k = 1 if rank == 0 else 2
        return [dict(params=ps[:k]), dict(params=ps[k:])]
    train(rank, world, groups=groups, words=("param", "group"), must_refuse=True)


def per_rank_param_count(rank, world):
    def groups(m):
        ps = [p for p in m.parameters() if p.requires_grad]
        return [dict(params=ps if rank == 0 else ps[:-1])]
    train(rank, world, groups=groups, words=("param",), must_refuse=True)


def per_rank_shapes(rank, world):
    base = base_model()
    if rank == 1:
        base.fc2 = nn.Linear(7, 4)
    try:
        zerokern.ZeroAdamW(base.parameters(), stage=2)
    except Exception as exc:  # noqa: BLE001
        named(exc, ("shape", "param"))
        return
    raise Silent("different shapes by rank accepted")


def per_rank_dtypes(rank, world):
    base = base_model(torch.float32 if rank == 0 else torch.bfloat16)
    try:
        zerokern.ZeroAdamW(base.parameters(), stage=2)
    except Exception as exc:  # noqa: BLE001
        named(exc, ("dtype", "bfloat16"))
        return
    raise Silent("different dtypes by rank accepted")


def per_rank_add_group(hp_diff):
    def fn(rank, world):
        base = base_model()
        params = [p for p in base.parameters() if p.requires_grad]
        opt = zerokern.ZeroAdamW(params[:2], stage=2)
        g = dict(params=params[2:])
        if hp_diff:
            g["lr"] = 1e-3 * (rank + 1)
        elif rank == 1:
            g["params"] = params[2:3]
        try:
            opt.add_param_group(g)
        except Exception as exc:  # noqa: BLE001
            named(exc, ("lr", "param"))
            return
        raise Silent("add_param_group differing by rank accepted")
    return fn


# -- family 2: edits of p.grad ----------------------------------------------------------------
def _trained(ps):
    return [p for p in ps if p.requires_grad]


def e_scale_all(ours, ref, rank, step, opt):
    for p in _trained(ours):
        p.grad.mul_(0.5)
    for p in ref:
        if p.grad is not None:
            p.grad.mul_(0.5)


def e_scale_twice(ours, ref, rank, step, opt):
    e_scale_all(ours, ref, rank, step, opt)
    e_scale_all(ours, ref, rank, step, opt)


def e_div_all(ours, ref, rank, step, opt):
    for p in _trained(ours):
        p.grad.div_(4.0)
    for p in ref:
        if p.grad is not None:
            p.grad.div_(4.0)


def e_zero_all(ours, ref, rank, step, opt):
    for p in _trained(ours):
        p.grad.zero_()
    for p in ref:
        if p.grad is not None:
            p.grad.zero_()


def e_scale_one(ours, ref, rank, step, opt):
    _trained(ours)[0].grad.mul_(0.5)
    _trained(ref)[0].grad.mul_(0.5)


def e_set_same(ours, ref, rank, step, opt):
    for p, r in zip(_trained(ours), [r for r in ref if r.requires_grad]):
        g = torch.full_like(p, 0.25, dtype=p.dtype)
        p.grad = g
        r.grad = torch.full_like(r, 0.25)


def e_set_diff(ours, ref, rank, step, opt):
    for p, r in zip(_trained(ours), [r for r in ref if r.requires_grad]):
        p.grad = torch.full_like(p, float(rank + 1))
        r.grad = torch.full_like(r, float(rank + 1))


def e_none_one(ours, ref, rank, step, opt):
    _trained(ours)[0].grad = None
    _trained(ref)[0].grad = None


def e_none_all(ours, ref, rank, step, opt):
    for p in _trained(ours):
        p.grad = None
    for r in ref:
        r.grad = None


def e_wrong_dtype(ours, ref, rank, step, opt):
    p = _trained(ours)[0]
    p.grad = torch.ones(p.shape, dtype=torch.float64)


def e_wrong_shape(ours, ref, rank, step, opt):
    p = _trained(ours)[0]
    p.grad = torch.ones(p.numel() + 1, dtype=p.dtype)


def e_wrong_device(ours, ref, rank, step, opt):
    p = _trained(ours)[0]
    p.grad = torch.ones(p.shape, dtype=p.dtype, device="meta")


def e_frozen(ours, ref, rank, step, opt):
    # torch.optim.AdamW would update a frozen parameter with a hand-set grad only if it were
    # in its groups; here neither optimizer holds the frozen one, so it must not move.
    fz = [p for p in ours if not p.requires_grad][0]
    fz.grad = torch.ones_like(fz)


def e_clip(ours, ref, rank, step, opt):
    torch.nn.utils.clip_grad_norm_(_trained(ours), 0.05)
    torch.nn.utils.clip_grad_norm_([p for p in ref if p.grad is not None], 0.05)


def e_clip_then_scale(ours, ref, rank, step, opt):
    e_clip(ours, ref, rank, step, opt)
    e_scale_all(ours, ref, rank, step, opt)


def e_read(ours, ref, rank, step, opt):
    float(_trained(ours)[0].grad.sum())
    # reading is harmless: the reference just proceeds


def e_clip_value(ours, ref, rank, step, opt):
    torch.nn.utils.clip_grad_value_(_trained(ours), 0.01)
    torch.nn.utils.clip_grad_value_([p for p in ref if p.grad is not None], 0.01)


def e_norm(ours, ref, rank, step, opt):
    a = torch.linalg.vector_norm(_trained(ours)[0].grad).item()
    b = torch.linalg.vector_norm(_trained(ref)[0].grad).item()
    if not math.isclose(a, b, rel_tol=1e-4):
        raise Silent(f"norm of p.grad {a} vs {b}")


def e_add_(ours, ref, rank, step, opt):
    for p in _trained(ours):
        p.grad.add_(1.0)
    for p in ref:
        if p.grad is not None:
            p.grad.add_(1.0)


EDITS = {
    "scale_all": (e_scale_all, ()),
    "scale_twice": (e_scale_twice, ()),
    "div_all": (e_div_all, ()),
    "zero_all": (e_zero_all, ()),
    "scale_one_param": (e_scale_one, ("clip_grad_norm_", "coefficient", "scal")),
    "set_same_by_hand": (e_set_same, ("grad",)),
    "set_diff_by_rank": (e_set_diff, ("grad",)),
    "set_none_one": (e_none_one, ("grad",)),
    "set_none_all": (e_none_all, ("grad",)),
    "wrong_dtype": (e_wrong_dtype, ("dtype", "type")),
    "wrong_shape": (e_wrong_shape, ("shape", "size")),
    "wrong_device": (e_wrong_device, ("device",)),
    "frozen_param_grad": (e_frozen, ("frozen", "requires_grad")),
    "clip_grad_norm": (e_clip, ()),
    "clip_then_scale": (e_clip_then_scale, ("clip",)),
    "read_values": (e_read, ("clip_grad_norm_",)),
    "clip_grad_value": (e_clip_value, ("clip_grad_norm_",)),
    "vector_norm": (e_norm, ()),
    "add_scalar": (e_add_, ("clip_grad_norm_",)),
}
# Edits whose result cannot match the reference: a refusal is the only good answer.
MUST_REFUSE = {"scale_one_param", "set_diff_by_rank", "wrong_dtype", "wrong_shape",
               "wrong_device", "read_values", "clip_grad_value", "add_scalar"}


def grad_edit(edit_name, stage):
    fn_, words = EDITS[edit_name]

    def fn(rank, world):
        train(rank, world, stage=stage, edit=fn_, words=words,
              must_refuse=edit_name in MUST_REFUSE)
    return fn


def grad_edit_no_sync(stage):
    def ed(ours, ref, rank, step, opt):
        pass

    def fn(rank, world):
        # Edit the local gradient between a no_sync backward and the synchronised one.
        base = base_model()
        ours = ours_model(base, stage)
        ref = copy.deepcopy(base)
        opt = zerokern.ZeroAdamW(ours.parameters(), lr=1e-2, stage=stage)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        for step in range(2):
            x, y = data(step, rank)
            with opt.no_sync():
                F.cross_entropy(ours(x), y).backward()
            F.cross_entropy(ref(x), y).backward()
            try:
                for p in _trained(ours.parameters()):
                    if p.grad is not None:
                        p.grad.mul_(0.5)
            except Exception as exc:  # noqa: BLE001
                named(exc, ("no_sync", "clip_grad_norm_"))
                return
            for p in _trained(ref.parameters()):
                p.grad.mul_(0.5)
            x, y = data(step + 50, rank)
            F.cross_entropy(ours(x), y).backward()
            F.cross_entropy(ref(x), y).backward()
            average(ref.parameters(), world)
            opt.step()
            ropt.step()
            opt.zero_grad()
            ropt.zero_grad()
            close(full(ours, stage), full(ref, 0), torch.float32, f"step {step}")
    return fn


# -- family 3: state dicts --------------------------------------------------------------------
FORMATS = [("fp32", "fp32", torch.float32), ("bf16", "fp32", torch.float32),
           ("int8", "fp32", torch.float32), ("fp32", "none", torch.bfloat16),
           ("bf16", "none", torch.bfloat16), ("int8", "none", torch.bfloat16)]


def _dtype_of(model):
    """The dtype the model's inputs must have (its parameters')."""
    return next(model.parameters()).dtype


def _run(model, opt, rank, steps, start=0):
    for step in range(start, start + steps):
        x, y = data(step, rank)
        F.cross_entropy(model(x.to(_dtype_of(model))).float(), y).backward()
        opt.step()
        opt.zero_grad()


def _opt(model, stage, moments, master, **kw):
    return zerokern.ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, moments=moments,
                              master=master, seed=3, eps=kw.pop("eps", 1e-6), **kw)


def sd_roundtrip(kind, moments, master, dtype, stage):
    """Train 2 steps, save (kind), load into a fresh optimizer on a copy of the model, train 2
    more: bit for bit the uninterrupted run."""
    def fn(rank, world):
        base = base_model(dtype)
        a = ours_model(base, stage)
        oa = _opt(a, stage, moments, master)
        _run(a, oa, rank, 2)
        sd = oa.state_dict() if kind == "rank" else oa.full_state_dict(rank0_only=False)
        snap = full(a, stage)
        b = ours_model(base, stage)
        # the model's own state dict (at stage 3 the plain model's keys, each rank its part)
        b.load_state_dict(a.state_dict())
        ob = _opt(b, stage, moments, master)
        ob.load_state_dict(copy.deepcopy(sd))
        _run(a, oa, rank, 2, 2)
        _run(b, ob, rank, 2, 2)
        fa, fb = full(a, stage), full(b, stage)
        for k in fa:
            if not torch.equal(fa[k], fb[k]):
                if kind == "full" and moments == "int8":
                    # Dequantize + requantize: documented as exact? report the size.
                    raise Silent(f"{k} differs after a full round trip by "
                                 f"{(fa[k] - fb[k]).abs().max().item():.3g}")
                raise Silent(f"{k} differs after the round trip by "
                             f"{(fa[k] - fb[k]).abs().max().item():.3g}")
        del snap
    return fn



def torch_sd_into(moments, master, dtype, stage):
    """A torch.optim.AdamW state dict (single process, 2 steps on rank 0's data) loaded into
    each format, then one more step each: within the format's exactness of torch's."""
    def fn(rank, world):
        base = base_model(dtype)
        ref = copy.deepcopy(base).float()
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6, foreach=False)
        _run(ref, ropt, 0, 2)
        ours_base = copy.deepcopy(ref).to(dtype)
        ours = ours_model(ours_base, stage)
        opt = _opt(ours, stage, moments, master)
        try:
            opt.load_state_dict(copy.deepcopy(ropt.state_dict()))
        except Exception as exc:  # noqa: BLE001
            named(exc, ("state",))
            raise Unclear(f"refused a torch AdamW state dict: {exc}") from None
        # the same gradient on every rank: both see the mean of the two ranks' batches
        for model, o in ((ours, opt), (ref, ropt)):
            x0, y0 = data(9, 0)
            x1, y1 = data(9, 1)
            if model is ours:
                x, y = (x0, y0) if rank == 0 else (x1, y1)
                F.cross_entropy(model(x.to(dtype)).float(), y).backward()
            else:
                (0.5 * (F.cross_entropy(model(x0), y0) + F.cross_entropy(model(x1), y1))
                 ).backward()
            o.step()
            o.zero_grad()
        got = full(ours, stage)
        want = {k: v.float() for k, v in ref.state_dict().items()}
        if moments == "fp32" and master == "fp32":
            close(got, want, torch.float32, "after load")
        else:
            # compressed: one step of lr=1e-2 moves at most ~lr; a wrong state moves more
            for k in want:
                d = (got[k] - want[k]).abs().max().item()
                if d > 2e-3 + (0.02 if dtype == torch.bfloat16 else 0.0):
                    raise Silent(f"{k} off by {d:.3g} after loading torch's state")
        # and back out: full_state_dict moments close to torch's
        sd = opt.full_state_dict(rank0_only=False)
        rs = ropt.state_dict()
        for i, st in rs["state"].items():
            if int(float(sd["state"][i]["step"])) != int(float(st["step"])):
                raise Silent(f"step {sd['state'][i]['step']} vs {st['step']}")
    return fn


def sd_into_other_stage(s_from, s_to):
    def fn(rank, world):
        base = base_model()
        a = ours_model(base, s_from)
        oa = zerokern.ZeroAdamW(a.parameters(), lr=1e-2, stage=s_from)
        ref = copy.deepcopy(base)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        for step in range(2):
            x, y = data(step, rank)
            F.cross_entropy(a(x), y).backward()
            oa.step()
            oa.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            average(ref.parameters(), world)
            ropt.step()
            ropt.zero_grad()
        sd = oa.full_state_dict(rank0_only=False)
        b = ours_model(copy.deepcopy(ref), s_to)
        ob = zerokern.ZeroAdamW(b.parameters(), lr=1e-2, stage=s_to)
        ob.load_state_dict(sd)
        x, y = data(7, rank)
        F.cross_entropy(b(x), y).backward()
        ob.step()
        F.cross_entropy(ref(x), y).backward()
        average(ref.parameters(), world)
        ropt.step()
        close(full(b, s_to), full(ref, 0), torch.float32, "after stage change")
    return fn


def _trained_opt(rank, stage=2, moments="fp32", master="fp32", dtype=torch.float32):
    base = base_model(dtype)
    m = ours_model(base, stage)
    o = _opt(m, stage, moments, master)
    _run(m, o, rank, 1)
    return m, o


def bad_sd(mutate, words, stage=2, full_sd=False, moments="fp32"):
    def fn(rank, world):
        m, o = _trained_opt(rank, stage, moments)
        sd = o.full_state_dict(rank0_only=False) if full_sd else o.state_dict()
        sd = copy.deepcopy(sd)
        mutate(sd)
        before = full(m, stage)
        inner_before = copy.deepcopy(o.state_dict())
        try:
            o.load_state_dict(sd)
        except Exception as exc:  # noqa: BLE001
            named(exc, words)
            unchanged(m, stage, before, "load")
            after = o.state_dict()
            if not _sd_equal(after, inner_before):
                raise Silent("optimizer state modified by a refused load") from None
            return
        raise Silent("a bad state dict was accepted")
    return fn


def sd_missing_param_is_fresh():
    """A torch-format state dict without one parameter's state: torch's AdamW loads it and
    that parameter starts afresh (no state, step 0), as one that never had a gradient; so
    must ZeroAdamW, keeping every other parameter's state as given."""
    def fn(rank, world):
        m, o = _trained_opt(rank, 2, "fp32")
        sd = copy.deepcopy(o.full_state_dict(rank0_only=False))
        gone = next(iter(sd["state"]))
        sd["state"].pop(gone)
        o.load_state_dict(copy.deepcopy(sd))
        out = o.full_state_dict(rank0_only=False)
        st = out["state"].get(gone)
        if st and (int(float(st["step"])) != 0
                   or any(bool(st[k].any()) for k in ("exp_avg", "exp_avg_sq"))):
            raise Silent(f"parameter {gone} kept a state the state dict did not hold")
        for i, want in sd["state"].items():
            for k, v in want.items():
                if not torch.equal(torch.as_tensor(out["state"][i][k]).float(),
                                   torch.as_tensor(v).float()):
                    raise Silent(f"{k} of parameter {i} differs from the state dict's")
    return fn


def _sd_equal(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _sd_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_sd_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _first_tensor_key(d):
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            return k
        if isinstance(v, dict):
            r = _first_tensor_key(v)
            if r is not None:
                return r
    return None


def m_drop_state(sd):
    sd.pop("state")


def m_extra_key(sd):
    sd["bogus"] = 1


def m_drop_groups(sd):
    sd.pop("param_groups")


def m_full_step_str(sd):
    for st in sd["state"].values():
        st["step"] = "two"


def m_full_shape(sd):
    st = next(iter(sd["state"].values()))
    st["exp_avg"] = torch.zeros(st["exp_avg"].numel() + 1)



def m_full_neg_step(sd):
    for st in sd["state"].values():
        st["step"] = torch.tensor(-1.0)


def m_full_nan(sd):
    st = next(iter(sd["state"].values()))
    st["exp_avg_sq"] = torch.full_like(st["exp_avg_sq"], float("nan"))


def m_full_neg_v(sd):
    st = next(iter(sd["state"].values()))
    st["exp_avg_sq"] = -torch.ones_like(st["exp_avg_sq"])


def m_full_groups_len(sd):
    sd["param_groups"].append(dict(sd["param_groups"][0]))


def m_full_group_params(sd):
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]


def m_rank_shape(sd):
    _shrink_first(sd["state"])


def _shrink_first(d):
    for k, v in d.items():
        if isinstance(v, torch.Tensor) and v.numel() > 1:
            d[k] = v[:-1].clone() if v.dim() else v
            return True
        if isinstance(v, dict) and _shrink_first(v):
            return True
    return False


def m_rank_step_type(sd):
    sd["state"]["steps"] = "three"  # a per-rank state dict keeps its step counts there



def state_edit(stage):
    """opt.state[p] edited in place (as a script resetting moments does): the next step
    must honour it (= torch AdamW with the same edit) or refuse."""
    def fn(rank, world):
        base = base_model()
        m = ours_model(base, stage)
        o = zerokern.ZeroAdamW(m.parameters(), lr=1e-2, stage=stage)
        ref = copy.deepcopy(base)
        ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        for step in range(2):
            x, y = data(step, rank)
            F.cross_entropy(m(x), y).backward()
            F.cross_entropy(ref(x), y).backward()
            average(ref.parameters(), world)
            if step == 1:
                p = next(iter(o.managed_params))
                try:
                    o.state[p]["exp_avg"].zero_()
                except Exception as exc:  # noqa: BLE001
                    named(exc, ("state",))
                    return
                rp = next(p for p in ref.parameters() if p.requires_grad)
                ro.state[rp]["exp_avg"].zero_()
            o.step()
            ro.step()
            o.zero_grad()
            ro.zero_grad()
        close(full(m, stage), full(ref, 0), torch.float32, "after opt.state edit")
    return fn


def sd_wrong_format(src, dst):
    def fn(rank, world):
        m, o = _trained_opt(rank, 2, src[0], src[1], src[2])
        sd = o.state_dict()
        m2 = ours_model(base_model(dst[2]), 2)
        o2 = _opt(m2, 2, dst[0], dst[1])
        _run(m2, o2, rank, 1)
        try:
            o2.load_state_dict(sd)
        except Exception as exc:  # noqa: BLE001
            named(exc, ("moments", "master", "format"))
            return
        raise Silent(f"a {src} per-rank state loaded into {dst}")
    return fn


# -- family 4: bad inputs ---------------------------------------------------------------------
def bad_ctor(kw, words, torch_ok=False, params=None, stage=2):
    """ZeroAdamW(params, **kw) must refuse naming ``words`` (or, where torch.optim.AdamW
    accepts the same, train to its result)."""
    def fn(rank, world):
        if torch_ok:
            train(rank, world, stage=stage, kw=kw, words=words)
            return
        base = base_model()
        ps = params(base) if params else base.parameters()
        before = {k: v.clone() for k, v in base.state_dict().items()}
        try:
            zerokern.ZeroAdamW(ps, stage=stage, **kw)
        except Exception as exc:  # noqa: BLE001
            named(exc, words)
            for k, v in base.state_dict().items():
                if not torch.equal(v, before[k]):
                    raise Silent(f"{k} modified by a refused construction") from None
            return
        raise Silent(f"accepted {kw or 'these params'}")
    return fn


def meta_params(rank, world):
    with torch.device("meta"):
        m = Net()
    try:
        zerokern.ZeroAdamW(m.parameters(), stage=2)
    except Exception as exc:  # noqa: BLE001
        named(exc, ("meta",))
        return
    raise Silent("meta params accepted")


def non_leaf(rank, world):
    w = torch.randn(3, requires_grad=True) * 2
    try:
        zerokern.ZeroAdamW([w], stage=2)
    except Exception as exc:  # noqa: BLE001
        named(exc, ("leaf",))
        return
    raise Silent("non-leaf accepted")


def requires_grad_toggle(off):
    def fn(rank, world):
        base = base_model()
        ref = copy.deepcopy(base)
        o = zerokern.ZeroAdamW(base.parameters(), lr=1e-2, stage=2)
        ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        # toggle after construction (freeze fc1.weight, or unfreeze frozen)
        for m in (base, ref):
            if off:
                m.fc1.weight.requires_grad_(False)
            else:
                m.frozen.requires_grad_(True)
        for step in range(2):
            x, y = data(step, rank)
            try:
                F.cross_entropy(base(x), y).backward()
                o.step()
            except Exception as exc:  # noqa: BLE001
                named(exc, ("requires_grad", "frozen"))
                return
            F.cross_entropy(ref(x), y).backward()
            average(ref.parameters(), world)
            ro.step()
            o.zero_grad()
            ro.zero_grad()
        close(full(base, 0), full(ref, 0), torch.float32, "after toggle")
    return fn


def closure_case(stage):
    def fn(rank, world):
        base = base_model()
        m = ours_model(base, stage)
        ref = copy.deepcopy(base)
        o = zerokern.ZeroAdamW(m.parameters(), lr=1e-2, stage=stage)
        ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        x, y = data(0, rank)

        def closure():
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            return loss

        try:
            loss = o.step(closure)
        except Exception as exc:  # noqa: BLE001
            named(exc, ("closure",))
            return
        F.cross_entropy(ref(x), y).backward()
        average(ref.parameters(), world)
        rl = ro.step()
        del rl
        if not torch.is_tensor(loss):
            raise Silent(f"step(closure) returned {loss!r}")
        close(full(m, stage), full(ref, 0), torch.float32, "closure step")
    return fn


def step_before_backward(stage):
    def fn(rank, world):
        base = base_model()
        m = ours_model(base, stage)
        o = zerokern.ZeroAdamW(m.parameters(), lr=1e-2, stage=stage)
        before = full(m, stage)
        try:
            o.step()
        except Exception as exc:  # noqa: BLE001
            named(exc, ("backward", "grad"))
            return
        unchanged(m, stage, before, "step before backward (torch: no-op)")
    return fn


def duplicate_across_groups(rank, world):
    base = base_model()
    ps = [p for p in base.parameters() if p.requires_grad]
    try:
        zerokern.ZeroAdamW([dict(params=ps), dict(params=ps[:1])], stage=2)
    except Exception as exc:  # noqa: BLE001
        named(exc, ("more than one", "duplicate", "appear"))
        return
    raise Silent("a param in two groups accepted")


def mixed_device_params(rank, world):
    base = base_model()
    ps = [p for p in base.parameters() if p.requires_grad] + [
        nn.Parameter(torch.zeros(3, device="meta"))]
    try:
        zerokern.ZeroAdamW(ps, stage=2)
    except Exception as exc:  # noqa: BLE001
        named(exc, ("device", "meta"))
        return
    raise Silent("mixed devices accepted")


def int_param(rank, world):
    p = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    base = base_model()
    try:
        o = zerokern.ZeroAdamW(list(base.parameters()) + [p], stage=2)
    except Exception as exc:  # noqa: BLE001
        named(exc, ("dtype", "float"))
        return
    del o  # a frozen int tensor is harmless: torch accepts it too


# -- the case list ----------------------------------------------------------------------------
def cases():
    out = []

    def add(name, fam, fn):
        out.append((name, fam, fn))

    # family 1
    for name, v0, v1, agreeable in [
        ("stage", 1, 2, False), ("bucket_numel", 16, 64, False),
        ("moments", "fp32", "bf16", False), ("seed", 0, 1, True),  # seed: unused at fp32
        ("reduce_dtype", None, torch.float32, False), ("loss_scale", None, 128.0, False),
        ("loss_scale", "dynamic", None, False), ("max_grad_norm", None, 0.1, False),
        ("max_grad_norm", 0.1, 0.2, False), ("lr", 1e-2, 2e-2, False),
        ("betas", (0.9, 0.95), (0.8, 0.95), False), ("eps", 1e-8, 1e-6, False),
        ("weight_decay", 0.1, 0.0, False), ("overlap_comm", True, False, True),
        ("backend", "torch", "cpu", True), ("offload", None, "cpu", False),
    ]:
        add(f"per_rank {name}={v0!r}/{v1!r}", 1, per_rank_option(name, v0, v1,
                                                                agreeable=agreeable))
    add("per_rank seed (master=none)", 1, per_rank_option("seed", 0, 1, dtype=torch.bfloat16)
        if False else _seed_none)
    add("per_rank master fp32/none (bf16)", 1, _master_diff)
    for st in (0, 3):
        add(f"per_rank lr stage {st}", 1, per_rank_option("lr", 1e-2, 2e-2, stage=st))
        add(f"per_rank max_grad_norm stage {st}", 1,
            per_rank_option("max_grad_norm", None, 1.0, stage=st))
    add("per_rank group lr", 1, per_rank_groups)
    add("per_rank group split", 1, per_rank_group_split)
    add("per_rank param count", 1, per_rank_param_count)
    add("per_rank shapes", 1, per_rank_shapes)
    add("per_rank dtypes", 1, per_rank_dtypes)
    add("per_rank add_param_group lr", 1, per_rank_add_group(True))
    add("per_rank add_param_group params", 1, per_rank_add_group(False))
    add("per_rank parallelize stage", 1, _parallelize_stage)
    # family 2
    for st in (0, 1, 2, 3):
        for e in EDITS:
            add(f"grad {e} stage {st}", 2, grad_edit(e, st))
        add(f"grad no_sync mul_ stage {st}", 2, grad_edit_no_sync(st))
    # family 3
    for mo, ma, dt in FORMATS:
        for st in (1, 2):
            add(f"sd rank roundtrip {mo}/{ma} stage {st}", 3, sd_roundtrip("rank", mo, ma, dt, st))
        add(f"sd full roundtrip {mo}/{ma}", 3, sd_roundtrip("full", mo, ma, dt, 2))
        add(f"sd torch AdamW into {mo}/{ma}", 3, torch_sd_into(mo, ma, dt, 2))
    add("sd rank roundtrip fp32 stage 3", 3, sd_roundtrip("rank", "fp32", "fp32", torch.float32, 3))
    add("sd full roundtrip int8 stage 3", 3, sd_roundtrip("full", "int8", "fp32", torch.float32, 3))
    add("sd torch AdamW into fp32 stage 0", 3, torch_sd_into("fp32", "fp32", torch.float32, 0))
    add("sd torch AdamW into fp32 stage 3", 3, torch_sd_into("fp32", "fp32", torch.float32, 3))
    for a, b in ((2, 3), (3, 1), (0, 2), (1, 0)):
        add(f"sd full stage {a} -> {b}", 3, sd_into_other_stage(a, b))
    add("sd rank: no 'state'", 3, bad_sd(m_drop_state, ("state",)))
    add("sd rank: extra key", 3, bad_sd(m_extra_key, ("bogus", "key")))
    add("sd rank: no param_groups", 3, bad_sd(m_drop_groups, ("param_groups",)))
    add("sd rank: wrong shape", 3, bad_sd(m_rank_shape, ("shape", "numel", "size")))
    add("sd rank: step a str", 3, bad_sd(m_rank_step_type, ("step",)))
    add("sd full: step a str", 3, bad_sd(m_full_step_str, ("step",), full_sd=True))
    add("sd full: wrong shape", 3, bad_sd(m_full_shape, ("shape", "exp_avg"), full_sd=True))
    add("sd full: a param missing (fresh, as torch)", 3, sd_missing_param_is_fresh())
    add("sd full: negative step", 3, bad_sd(m_full_neg_step, ("step",), full_sd=True))
    add("sd full: NaN exp_avg_sq", 3, bad_sd(m_full_nan, ("exp_avg_sq", "finite", "nan"),
                                             full_sd=True))
    add("sd full: negative exp_avg_sq", 3, bad_sd(m_full_neg_v, ("exp_avg_sq", "negative"),
                                                  full_sd=True))
    add("sd full: extra group", 3, bad_sd(m_full_groups_len, ("group",), full_sd=True))
    add("sd full: group param list", 3, bad_sd(m_full_group_params, ("param",), full_sd=True))
    add("sd full: int8 wrong shape", 3, bad_sd(m_full_shape, ("shape", "exp_avg"), full_sd=True,
                                               moments="int8"))
    add("sd rank: int8 wrong shape", 3, bad_sd(m_rank_shape, ("shape", "numel", "size"),
                                               moments="int8"))
    add("sd rank stage 3: wrong shape", 3, bad_sd(m_rank_shape, ("shape", "numel", "size"),
                                                  stage=3))
    for st in (0, 2, 3):
        add(f"opt.state[p] edit stage {st}", 3, state_edit(st))
    add("sd rank fp32 -> int8", 3, sd_wrong_format(FORMATS[0], FORMATS[2]))
    add("sd rank bf16/none -> fp32/none", 3, sd_wrong_format(FORMATS[4], FORMATS[3]))
    # family 4
    for kw, words in [
        (dict(lr=float("nan")), ("lr",)), (dict(lr=float("inf")), ("lr",)),
        (dict(lr=-1.0), ("lr",)),
        (dict(lr="0.1"), ("lr",)), (dict(betas=(1.0, 0.9)), ("beta",)),
        (dict(betas=(0.9, float("nan"))), ("beta",)), (dict(betas=(0.9,)), ("beta",)),
        (dict(eps=-1e-8), ("eps",)), (dict(eps=float("nan")), ("eps",)),
        (dict(weight_decay=float("nan")), ("weight_decay",)),
        (dict(weight_decay=-0.1), ("weight_decay",)),
        (dict(stage=4), ("stage",)), (dict(stage="2"), ("stage",)), (dict(stage=True), ("stage",)),
        (dict(bucket_numel=0), ("bucket_numel",)), (dict(bucket_numel=2.5), ("bucket_numel",)),
        (dict(max_grad_norm=-1.0), ("max_grad_norm",)),
        (dict(max_grad_norm=float("nan")), ("max_grad_norm",)),
        (dict(loss_scale=0.0), ("loss_scale",)), (dict(loss_scale="static"), ("loss_scale",)),
        (dict(loss_scale=float("inf")), ("loss_scale",)),
        (dict(backend="gpu"), ("backend",)), (dict(offload="disk"), ("offload",)),
        (dict(moments="fp8"), ("moments",)), (dict(master="bf16"), ("master",)),
        (dict(master="none"), ("master", "bf16")), (dict(seed=-1), ("seed",)),
        (dict(seed=2**63), ("seed",)), (dict(reduce_dtype=torch.float16), ("reduce_dtype",)),
        (dict(amsgrad=True), ("amsgrad",)), (dict(maximize=True), ("maximize",)),
        (dict(overlap_comm="yes"), ("overlap_comm",)), (dict(moments="int8", eps=0.0), ("eps",)),
        (dict(config="stage2"), ("config",)), (dict(mesh="2x1"), ("mesh",)),
        (dict(process_group=5), ("process_group",)),
    ]:
        add(f"bad {kw}", 4, bad_ctor(kw, words))
    add("bad empty params", 4, bad_ctor({}, ("empty", "param"), params=lambda m: []))
    add("bad param is a tensor", 4, bad_ctor({}, ("iterable", "param"),
                                             params=lambda m: m.fc1.weight))
    add("bad duplicate params", 4, bad_ctor({}, ("duplicate", "more than once", "appear", "twice"),
                                            params=lambda m: [m.fc1.weight, m.fc1.weight]))
    add("bad duplicate across groups", 4, duplicate_across_groups)
    add("bad all frozen", 4, bad_ctor({}, ("requires_grad", "requires grad", "frozen", "train"),
                                      params=lambda m: [m.frozen]))
    add("bad meta params", 4, meta_params)
    add("bad meta + cpu params", 4, mixed_device_params)
    add("bad non-leaf", 4, non_leaf)
    add("bad int param (frozen)", 4, int_param)
    add("requires_grad off after ctor", 4, requires_grad_toggle(True))
    add("requires_grad on after ctor", 4, requires_grad_toggle(False))
    for st in (0, 2, 3):
        add(f"closure stage {st}", 4, closure_case(st))
        add(f"step before backward stage {st}", 4, step_before_backward(st))
    return out


def _seed_none(rank, world):
    train(rank, world, dtype=torch.bfloat16, kw=dict(master="none", seed=rank),
          words=("seed",), must_refuse=True)


def _master_diff(rank, world):
    train(rank, world, dtype=torch.bfloat16, kw=dict(master="none" if rank else "fp32"),
          words=("master",), must_refuse=True)


def _parallelize_stage(rank, world):
    base = base_model()
    try:
        zerokern.parallelize(base, stage=1 + rank, unit_classes=(nn.Linear,))
    except Exception as exc:  # noqa: BLE001
        named(exc, ("stage",))
        return
    raise Silent("parallelize with stage differing by rank accepted")


# -- the driver -------------------------------------------------------------------------------
def _in_rank(rank, world, index):
    name, fam, fn = cases()[index]
    torch.manual_seed(1234)
    try:
        fn(rank, world)
    except Silent as exc:
        raise RuntimeError(f"VERDICT silent: {exc}") from None
    except Unclear as exc:
        raise RuntimeError(f"VERDICT unclear: {exc}") from None
    except Exception as exc:  # noqa: BLE001
        # An exception the case did not expect: an error ZeroAdamW raised on a valid use,
        # or one it raised with words the case did not look for.
        raise RuntimeError(f"VERDICT unclear: unexpected {type(exc).__name__}: "
                           f"{str(exc)[:300]}") from None


def _noop(rank, world):
    dist.barrier()


def main():
    import dist_utils

    argv = sys.argv[1:]
    pick = argv[argv.index("-k") + 1] if "-k" in argv else None
    verbose = "-v" in argv
    table = []
    all_cases = cases()
    pool = None
    for i, (name, fam, _) in enumerate(all_cases):
        if pick and pick not in name:
            continue
        if pool is None:
            pool = dist_utils._Pool(2, "gloo")
            # Forming the group takes long on a loaded machine: not part of a case's time.
            pool.run(pickle.dumps((_noop, (), False)), 600.0)
        t = time.monotonic()
        errors = pool.run(pickle.dumps((_in_rank, (i,), False)), CASE_TIMEOUT)
        dt = time.monotonic() - t
        if not errors:
            verdict, why = "ok", ""
        else:
            pool.close(graceful=False)
            pool = None
            verdicts = []
            for _r, msg in sorted(errors.items()):
                if "VERDICT silent" in msg:
                    verdicts.append(("silent", msg.rsplit("VERDICT silent: ", 1)[1].strip()))
                elif "VERDICT unclear" in msg:
                    verdicts.append(("unclear", msg.rsplit("VERDICT unclear: ", 1)[1].strip()))
                else:
                    verdicts.append(("crash", msg.strip().splitlines()[-1]))
            order = {"crash": 0, "silent": 1, "unclear": 2}
            verdict, why = min(verdicts, key=lambda v: order[v[0]])
            if len(errors) < 2:
                why = f"(rank {next(iter(errors))} only) {why}"
        table.append((name, fam, verdict, why))
        print(f"{fam} {verdict:8s} {dt:5.1f}s {name}" + (f"\n      {why[:400]}" if why and
                                                          (verbose or verdict != "ok") else ""),
              flush=True)
    if pool is not None:
        pool.close(graceful=True)
    tot = {v: sum(1 for r in table if r[2] == v) for v in ("ok", "silent", "crash", "unclear")}
    print(f"\ntried {len(table)} / handled well {tot['ok']} / silently wrong {tot['silent']} / "
          f"crash {tot['crash']} / unclear error {tot['unclear']}")
    for fam in (1, 2, 3, 4):
        rows = [r for r in table if r[1] == fam]
        print(f"  family {fam}: {len(rows)} tried, "
              f"{sum(1 for r in rows if r[2] == 'ok')} handled well")


if __name__ == "__main__":
    main()
