"""A checkpoint and an ``opt.state_dict()`` written by the engine before the per-stage
redesign (tests/fixtures/pre_engine, made by tests/make_fixtures.py at commit 01df1f3) load
with today's code: the loaded state is the files' bytes (written again, bit for bit), and the
continuation equals torch AdamW (+ DDP) started from that state on this machine. (The
continuations recorded when the fixtures were made are kept for provenance only: another CPU
takes other SIMD paths in the model's matmuls.)"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from _tol import TRAIN_FP32
from dist_utils import run_ranks
from make_fixtures import build
from models import OddNet, batch
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP

import zerokern
from zerokern.cli.consolidate import consolidate

FIX = Path(__file__).parent / "fixtures" / "pre_engine"


def _loaded_state_is_the_files(model, opt, saved_dir: Path, tmp: Path, rank: int) -> None:
    """What was loaded is what the old files hold, bit for bit: compared with consolidate's
    reading of the same files (it reads the rank files itself, not through an optimizer), so
    no arithmetic happens between the two and the check holds on any machine."""
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
        consolidate(str(saved_dir), str(tmp / "model.safetensors"), str(tmp / "optim.pt"))
    torch.distributed.barrier()
    want_model = load_file(tmp / "model.safetensors")
    want_optim = torch.load(tmp / "optim.pt", weights_only=True)
    got_model = zerokern.full_state_dict(model, rank0_only=False)
    for k, v in want_model.items():
        assert torch.equal(got_model[k], v), k
    got_optim = opt.full_state_dict(rank0_only=False)
    for i, st in want_optim["state"].items():
        for key, t in st.items():
            assert torch.equal(torch.as_tensor(got_optim["state"][i][key]), torch.as_tensor(t)), \
                (i, key)


def _tensors(tree, prefix=""):
    """{path: tensor} of a nested dict."""
    if torch.is_tensor(tree):
        return {prefix: tree}
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    return out


def _reference_from(model, opt, world):
    """torch AdamW (+ DDP) started from the state zerokern loaded: the continuation's oracle,
    computed on the machine that runs the test (another CPU takes other SIMD paths in the
    model's matmuls, so numbers recorded elsewhere cannot be compared bit for bit)."""
    ref = OddNet()
    ref.load_state_dict(zerokern.full_state_dict(model, rank0_only=False))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2,
                             weight_decay=0.1, foreach=False)
    ropt.load_state_dict(opt.full_state_dict(rank0_only=False))
    return ref, (DDP(ref, find_unused_parameters=True) if world > 1 else ref), ropt


def _continue_both(model, opt, ref, run, ropt, rank, steps) -> None:
    for step in steps:
        x, y = batch(step, rank)
        for m in (model, run):
            F.cross_entropy(m(x, use_sometimes=step % 2 == 0), y).backward()
        opt.step()  # max_grad_norm=1.0, as build() made it
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ropt.step()
        opt.zero_grad(set_to_none=True)
        ropt.zero_grad(set_to_none=True)
    got = zerokern.full_state_dict(model, rank0_only=False)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1],
                                   msg=lambda m, n=n: f"{n}: {m}")


def _continue_checkpoint(rank: int, world: int, tmp: str) -> None:
    model, opt = build(2)
    extra = zerokern.load_checkpoint(FIX / "ck_stage2_world2", model, opt)
    assert extra == {"step": 3}
    _loaded_state_is_the_files(model, opt, FIX / "ck_stage2_world2", Path(tmp) / "again", rank)
    ref, run, ropt = _reference_from(model, opt, world)
    _continue_both(model, opt, ref, run, ropt, rank, range(3, 5))


def test_old_checkpoint_loads_and_continues_as_adamw(tmp_path):
    run_ranks(2, _continue_checkpoint, str(tmp_path), tmp_path=tmp_path)


def test_old_state_dict_loads_and_continues_as_adamw():
    saved = torch.load(FIX / "state_dict_stage1_world1.pt", weights_only=False)
    model, opt = build(1)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    for n, p in model.named_parameters():  # the loaded state itself, bit for bit
        assert torch.equal(p.detach(), saved["model"][n]), n
    mine, theirs = _tensors(opt.state_dict()["state"]), _tensors(saved["optimizer"]["state"])
    assert mine.keys() == theirs.keys()
    for k, t in theirs.items():
        assert torch.equal(mine[k], t), k
    ref, run, ropt = _reference_from(model, opt, 1)
    _continue_both(model, opt, ref, run, ropt, 0, range(3, 5))
