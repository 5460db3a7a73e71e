"""Writes tests/fixtures/pre_engine/: a checkpoint (stage 2, 2 ranks) and an
``opt.state_dict()`` (stage 1, 1 rank) of OddNet after 3 steps, as the engine before the
per-stage redesign wrote them (commit 01df1f3's formats), plus the parameters each run reached
after 2 more steps. tests/test_fixtures.py loads them with today's code, checks the loaded
state against the files bit for bit and the continuation against torch AdamW (+ DDP) started
from it on the machine that runs the test (the recorded continuations are provenance only:
another CPU's matmuls round differently). Rerunning this with today's code would test
nothing, so the fixture files are committed (a few tens of KB).

    python tests/make_fixtures.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_utils import run_ranks  # noqa: E402
from models import OddNet, batch  # noqa: E402

import zerokern  # noqa: E402

OUT = Path(__file__).parent / "fixtures" / "pre_engine"


def build(stage: int) -> tuple[torch.nn.Module, zerokern.ZeroAdamW]:
    torch.manual_seed(0)
    model = OddNet()
    opt = zerokern.ZeroAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, stage=stage,
                             bucket_numel=256, max_grad_norm=1.0)
    return model, opt


def train(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        x, y = batch(step, rank)
        torch.nn.functional.cross_entropy(model(x, use_sometimes=step % 2 == 0), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _stage2_world2(rank: int, world: int, out: str) -> None:
    model, opt = build(2)
    train(model, opt, rank, range(3))
    zerokern.save_checkpoint(Path(out, "ck_stage2_world2"), model, opt, extra={"step": 3})
    train(model, opt, rank, range(3, 5))
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                   Path(out, "ck_stage2_world2_after5.pt"))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(2, _stage2_world2, str(OUT), tmp_path=Path(tmp))
    model, opt = build(1)
    train(model, opt, 0, range(3))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
               OUT / "state_dict_stage1_world1.pt")
    train(model, opt, 0, range(3, 5))
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
               OUT / "state_dict_stage1_world1_after5.pt")
    print(f"wrote {sorted(p.name for p in OUT.iterdir())}")


if __name__ == "__main__":
    main()
