"""load_checkpoint(path, model, None): the weights and buffers only, for evaluation, into a
plain model or a shard_model'ed one, at another world size or stage than the save; trained
parameters take their fp32 master rounded to the parameter's dtype, as a full load does."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from models import Block, TinyGPT
from test_checkpoint import build, train

import zerokern
from zerokern.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def weights_only_case(rank, world, save_stage, load_stage, dtype, tmp):
    model, opt = build(save_stage, dtype=dtype, seed=3)
    train(model, opt, 0, 3, rank, world)
    save_checkpoint(tmp, model, opt)
    # What a full load (model + optimizer) puts into the model: the reference.
    ref_model, ref_opt = build(save_stage, dtype=dtype, seed=5)
    load_checkpoint(tmp, ref_model, ref_opt)
    want = zerokern.full_state_dict(ref_model, rank0_only=False)

    torch.manual_seed(9)
    fresh = TinyGPT().to(dtype)
    fresh.register_buffer("seen", torch.zeros(2, dtype=torch.int64) - 1)
    if load_stage == 3:
        fresh = zerokern.shard_model(fresh, unit_classes=(Block,))
    assert load_checkpoint(tmp, fresh, None) is None  # extra: none was given
    got = zerokern.full_state_dict(fresh, rank0_only=False)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # A plain model on one rank alone (evaluation under `if rank == 0`): no collective.
    if rank == 0:
        alone = TinyGPT().to(dtype)
        alone.register_buffer("seen", torch.zeros(2, dtype=torch.int64))
        load_checkpoint(tmp, alone, None)
        for k, v in alone.state_dict().items():
            assert torch.equal(v, want[k]), k
    torch.distributed.barrier()


@pytest.mark.parametrize("save_stage,load_stage,dtype", [
    (2, 0, torch.float32), (1, 3, torch.float32), (3, 0, torch.bfloat16), (3, 3, torch.float32),
])
def test_weights_only_load(save_stage, load_stage, dtype, tmp_path):
    run_ranks(2, weights_only_case, save_stage, load_stage, dtype, str(tmp_path / "ck"),
              tmp_path=tmp_path)


def test_weights_only_load_refuses_another_model(tmp_path):
    model, opt = build(2)
    train(model, opt, 0, 1)
    save_checkpoint(tmp_path / "ck", model, opt)
    other = torch.nn.Linear(3, 3)
    before = other.weight.clone()
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_checkpoint(tmp_path / "ck", other, None)
    assert torch.equal(other.weight, before)


def test_weights_only_load_refuses_a_model_a_zero_adamw_trains(tmp_path):
    """Its fp32 master would overwrite the loaded weights at the next step: refused, the
    model untouched."""
    model, opt = build(2, dtype=torch.bfloat16)
    train(model, opt, 0, 1)
    save_checkpoint(tmp_path / "ck", model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="trained by a ZeroAdamW; pass it as the optimizer"):
        load_checkpoint(tmp_path / "ck", model, None)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
