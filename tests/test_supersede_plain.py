"""A second zerokern optimizer over all of a live one's parameters at stages 0-2 (a second
Lightning fit on the same LightningModule, a re-run notebook cell, a resume while the old
object still lives) takes them over, as at stage 3 (tests/test_stage3_two_optimizers.py): the
old one's hooks and guards come off, its step is refused, and the new one trains as a new
torch AdamW would from the same weights. Before, both reduced every gradient and the backward
died on the old one's guard."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from _tol import TRAIN_FP32
from dist_utils import run_ranks
from test_zero_parity import _ref_average

import zerokern

HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _steps(model, opt, ref, ropt, rank, world, start, n):
    for s in range(start, start + n):
        g = torch.Generator().manual_seed(100 * s + rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        _ref_average(ref, world)
        ropt.step()
        ropt.zero_grad()


def superseded_case(rank, world):
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        ref = copy.deepcopy(model)
        old = zerokern.ZeroAdamW(model.parameters(), stage=stage, bucket_numel=37, **HP)
        _steps(model, old, ref, torch.optim.AdamW(ref.parameters(), foreach=False, **HP),
               rank, world, 0, 2)
        new = zerokern.ZeroAdamW(model.parameters(), stage=stage, bucket_numel=37, **HP)
        ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)  # fresh moments too
        _steps(model, new, ref, ropt, rank, world, 2, 3)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=TRAIN_FP32[0],
                                       atol=TRAIN_FP32[1],
                                       msg=lambda m, n=n, s=stage: f"stage {s}: {n}: {m}")
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match="a newer zerokern optimizer was built over all"):
            old.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        # Part of a live optimizer's parameters: refused, naming the parameter.
        with pytest.raises(ValueError, match=r"parameter <parameter of shape \(8, 6\)> is "
                                             r"already trained by a live ZeroAdamW on this model"):
            zerokern.ZeroAdamW([model[0].weight], stage=stage)
        # The newer one dropped, the old one stays retired (its hooks are gone, and its
        # parameters named the newer one, so a clip would have used this rank's gradients).
        del new
        gc.collect()
        with pytest.raises(RuntimeError, match="a newer zerokern optimizer was built over all"):
            old.step()
        # Once dropped (del: an optimizer lives on in reference cycles until collected, on
        # each rank at its own time), part of its parameters may go to a new one.
        full = zerokern.ZeroAdamW(model.parameters(), stage=stage, bucket_numel=37, **HP)
        del old, full
        sub = zerokern.ZeroAdamW(model[2].parameters(), stage=stage, bucket_numel=37, **HP)
        rsub = torch.optim.AdamW(ref[2].parameters(), foreach=False, **HP)
        _steps(model, sub, ref, rsub, rank, world, 5, 1)
        torch.testing.assert_close(model[2].weight.detach(), ref[2].weight.detach(),
                                   rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1])


def test_a_new_optimizer_over_a_live_ones_parameters_takes_them_over(tmp_path):
    run_ranks(2, superseded_case, tmp_path=tmp_path)
