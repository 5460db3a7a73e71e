"""What users save of the model the usual way (torch.save of model.state_dict(), of a
parameter, of the model itself) loads with a plain torch.load, weights_only=True included, in
an interpreter where zerokern cannot even be imported; holds the same values; and is no
larger than the same save of a plain model (each tensor its own bytes). Stage 3 refuses the
saves that would hold no values. Plus the nanoGPT-style round trip: rank 0 saves the model's
state dict and the optimizer's full state, every rank resumes from them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from models import OddNet, batch

import zerokern
from zerokern.memory import Arena

HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05)
HERE = Path(__file__).parent


def _train(stage, dtype, offload, steps=2, seed=0, rank=0):
    torch.manual_seed(seed)
    model = OddNet().to(dtype)
    kw = {}
    if stage == 3:
        model = zerokern.shard_model(model, offload_params=offload)
    if offload:
        kw["offload"] = "cpu"
    opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, bucket_numel=61, **HP, **kw)
    for step in range(steps):
        x, y = batch(step, rank)
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save_case(rank, world, stage, dtype, offload, out):
    out = Path(out)
    model, _ = _train(stage, dtype, offload, rank=rank)
    full = zerokern.full_state_dict(model, rank0_only=False)
    sd = model.state_dict()  # stage 3: a collective, as full_state_dict
    plain = OddNet().to(dtype)
    plain.load_state_dict(full)
    torch.save(full, out / f"full{rank}.pt")
    saves = {"sd": (sd, plain.state_dict())}
    if stage < 3:
        saves["param"] = (model.fc1.weight, plain.fc1.weight)
        saves["model"] = (model, plain)
    else:  # outside a forward a rank holds only its slice: refused, naming what to save
        for obj in (model.fc1.weight, model, model.fc1):
            with pytest.raises(RuntimeError, match=r"model\.state_dict\(\)"):
                torch.save(obj, out / "refused.pt")
    for name, (ours, ref) in saves.items():
        torch.save(ours, out / f"{name}{rank}.pt")
        torch.save(ref, out / f"{name}{rank}.ref.pt")
        got, want = (os.path.getsize(out / f"{name}{rank}{s}.pt") for s in ("", ".ref"))
        assert got <= want, f"{name}: {got} bytes saved, a plain model's save is {want}"


# Run in a fresh interpreter in which `import zerokern` fails: the files must not need it.
_LOADER = r"""
import sys
sys.modules["zerokern"] = None
sys.path.insert(0, sys.argv[1])
import torch
args = sys.argv[2:]
for out, world, stage in zip(args[::3], map(int, args[1::3]), map(int, args[2::3])):
  for r in range(world):
      full = torch.load(f"{out}/full{r}.pt", weights_only=True)
      sd = torch.load(f"{out}/sd{r}.pt", weights_only=True)
      assert list(sd) == list(full), (list(sd), list(full))
      for k, v in full.items():
          assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
      if stage < 3:
          p = torch.load(f"{out}/param{r}.pt", weights_only=True)
          assert isinstance(p, torch.nn.Parameter) and torch.equal(p, full["fc1.weight"])
          m = torch.load(f"{out}/model{r}.pt", weights_only=False)
          for k, v in m.state_dict().items():
              assert torch.equal(v, full[k]), k
  print("loaded", out)
"""


def _load_without_zerokern(cases: list[tuple[Path, int, int]]) -> None:
    """Every case's files (its directory, world size, stage), in one fresh interpreter."""
    args = [str(x) for case in cases for x in case]
    r = subprocess.run([sys.executable, "-c", _LOADER, str(HERE), *args], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split().count("loaded") == len(cases), r.stdout


SAVE_CASES = [
    (0, torch.float32, False), (0, torch.bfloat16, False),
    (1, torch.float32, False), (1, torch.bfloat16, False), (1, torch.float32, True),
    (2, torch.float32, False), (2, torch.bfloat16, False), (2, torch.bfloat16, True),
    (3, torch.float32, False), (3, torch.bfloat16, False), (3, torch.float32, True),
]


def test_plain_torch_save_loads_anywhere(tmp_path):
    """Every case saved on 2 ranks (and three at world size one, in this process), then all
    loaded in one interpreter without zerokern."""
    cases = []
    for i, (stage, dtype, offload) in enumerate(SAVE_CASES):
        out = tmp_path / f"w2_stage{stage}_{str(dtype)[6:]}_{'off' if offload else 'on'}{i}"
        out.mkdir()
        run_ranks(2, save_case, stage, dtype, offload, str(out), tmp_path=tmp_path)
        cases.append((out, 2, stage))
    for stage in (0, 2, 3):
        out = tmp_path / f"w1_stage{stage}"
        out.mkdir()
        save_case(0, 1, stage, torch.bfloat16, False, str(out))
        cases.append((out, 1, stage))
    _load_without_zerokern(cases)


def resume_case(rank, world, stage, out):
    """nanoGPT's pattern: rank 0 saves {'model': model.state_dict(), 'optimizer': ...} with
    torch.save; every rank builds a fresh model and optimizer, torch.loads the file and goes
    on. The optimizer's part is opt.full_state_dict() (torch AdamW's format; the rank's own
    opt.state_dict() holds only its shard). fp32: the continuation equals the uninterrupted
    run bit for bit."""
    path = Path(out) / "ckpt.pt"
    model, opt = _train(stage, torch.float32, False, steps=2, rank=rank)
    ckpt = {"model": model.state_dict(), "optimizer": opt.full_state_dict(), "iter_num": 2}
    if rank == 0:
        torch.save(ckpt, path)
    torch.distributed.barrier()
    for step in range(2, 4):  # the uninterrupted run
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    want = zerokern.full_state_dict(model, rank0_only=False)

    loaded = torch.load(path, weights_only=True)
    torch.manual_seed(123)  # another initialisation: everything must come from the file
    fresh = OddNet()
    if stage == 3:
        fresh = zerokern.shard_model(fresh)
    fresh.load_state_dict(loaded["model"])
    fopt = zerokern.ZeroAdamW(fresh.parameters(), stage=stage, bucket_numel=61, **HP)
    fopt.load_state_dict(loaded["optimizer"])
    for step in range(loaded["iter_num"], 4):
        x, y = batch(step, rank)
        F.cross_entropy(fresh(x), y).backward()
        fopt.step()
        fopt.zero_grad()
    got = zerokern.full_state_dict(fresh, rank0_only=False)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nanogpt_style_save_and_resume(stage, tmp_path):
    run_ranks(2, resume_case, stage, str(tmp_path), tmp_path=tmp_path)


@pytest.mark.parametrize("capacity", [1, 255, 256, 1000, 4099, 65536 + 3])
def test_arena_storage_holds_whole_elements(capacity):
    """torch.load checks that a storage record holds whole elements of its dtype: the arena's
    backing storage is a whole number of the widest element whatever its capacity."""
    a = Arena(capacity, "cpu", alignment=64)
    assert a.buffer.untyped_storage().nbytes() % 16 == 0
    assert a.buffer.untyped_storage().nbytes() >= capacity


def test_bound_tensors_own_their_bytes():
    """Parameters bound to an arena block (and the engine's flat parameters) have a storage
    of exactly their own bytes, over the arena's memory."""
    a = Arena(4096, "cpu", alignment=64)
    blk = a.alloc(10, torch.float32)
    t = torch.nn.Parameter(torch.arange(10.0))
    blk.bind(t)
    assert t.untyped_storage().nbytes() == 40
    blk.tensor.add_(1)  # the same memory
    assert torch.equal(t.detach(), torch.arange(10.0) + 1)
    model, _ = _train(1, torch.bfloat16, False)
    for n, p in model.named_parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), n
