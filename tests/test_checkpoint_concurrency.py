"""Two jobs saving to one checkpoint path at once while a third process loads it in a loop:
every save completes, every load succeeds and reads one save whole (never a mix of two), and
afterwards the checkpoint loads and is one of the two jobs' last saves."""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
from dist_utils import rank_context

import zerokern
from zerokern.comm.rendezvous import file_init_method

SAVES = 60


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))


def _value(job: int, k: int) -> float:
    return 1000.0 * job + k


def _mark(model, opt, job, k):
    """Every parameter (and, fp32, its master) holds the value of save k of this job, and
    exp_avg too, so a load tells exactly which save it read, field by field."""
    v = _value(job, k)
    with opt.edit_shards() as shards:
        for sh in shards:
            for r in sh.ranges:
                r.values.fill_(v)
                r.exp_avg.fill_(v)
                r.exp_avg_sq.fill_(v)
            sh.step = k + 1


def _saver(job: int, path: str, rendezvous: str, out) -> None:
    try:
        # A real process group of its own (world size 1): what a second job would have.
        dist.init_process_group("gloo", init_method=rendezvous, rank=0, world_size=1)
        model = _model()
        opt = zerokern.ZeroAdamW(model.parameters(), stage=1)
        for k in range(SAVES):
            _mark(model, opt, job, k)
            zerokern.save_checkpoint(path, model, opt, extra={"job": job, "k": k})
        dist.destroy_process_group()
        out.put(("saver", job, None))
    except BaseException:
        out.put(("saver", job, traceback.format_exc()))


def _check_loaded(model, opt, extra) -> str | None:
    v = _value(extra["job"], extra["k"])
    for n, p in model.named_parameters():
        if not torch.all(p == v):
            return f"{n} holds {p.flatten()[:3].tolist()}, save {extra} wrote {v}"
    for sh in opt.shards():
        if sh.step != extra["k"] + 1:
            return f"step {sh.step}, save {extra} wrote {extra['k'] + 1}"
        for r in sh.ranges:
            if not (torch.all(r.exp_avg == v) and torch.all(r.exp_avg_sq == v)):
                return f"moments of parameter {sh.index} are not save {extra}'s"
    return None


def _loader(path: str, stop, out) -> None:
    try:
        model = _model()
        opt = zerokern.ZeroAdamW(model.parameters(), stage=1)
        loads, seen = 0, set()
        while not stop.is_set() or loads < 5:
            extra = zerokern.load_checkpoint(path, model, opt)
            bad = _check_loaded(model, opt, extra)
            if bad:
                out.put(("loader", loads, f"torn load: {bad}"))
                return
            loads += 1
            seen.add(extra["job"])
        out.put(("loader", loads, None))
    except BaseException:
        out.put(("loader", -1, traceback.format_exc()))


def test_two_jobs_saving_and_one_loading_never_tear(tmp_path):
    path = str(tmp_path / "ck")
    model = _model()
    opt = zerokern.ZeroAdamW(model.parameters(), stage=1)
    _mark(model, opt, 9, 0)
    zerokern.save_checkpoint(path, model, opt, extra={"job": 9, "k": 0})
    ctx = rank_context()  # fresh processes, forked from a server that imported torch once
    out, stop = ctx.Queue(), ctx.Event()
    savers = [ctx.Process(target=_saver, args=(j, path, file_init_method(str(tmp_path)), out))
              for j in (1, 2)]
    loader = ctx.Process(target=_loader, args=(path, stop, out))
    for p in savers + [loader]:
        p.start()
    results = []
    for _ in savers:
        results.append(out.get(timeout=600))
    stop.set()
    results.append(out.get(timeout=600))
    for p in savers + [loader]:
        p.join(timeout=60)
    errors = [r for r in results if r[2] is not None]
    assert not errors, errors
    loads = next(r[1] for r in results if r[0] == "loader")
    assert loads >= 5
    # Afterwards: one complete checkpoint, the last save of one of the two jobs, and no
    # staging or old directory left behind.
    extra = zerokern.load_checkpoint(path, model, opt)
    assert extra["k"] == SAVES - 1 and extra["job"] in (1, 2)
    assert _check_loaded(model, opt, extra) is None
    left = sorted(n for n in os.listdir(tmp_path) if n.startswith("ck"))
    assert left == ["ck", "ck.lock"], left
