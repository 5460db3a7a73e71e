"""ZeroAdamW stages 0-3 on one GPU over NCCL (world size 1) against torch.optim.AdamW.
Marked gpu: skipped without CUDA; bench/gpu_check.sh runs it on a lent GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _tol import U_BF16, adamw_step_bound
from dist_utils import run_ranks
from models import Block, TinyGPT, batch

import zerokern

pytestmark = pytest.mark.gpu


def nccl_parity(rank, world, stage, dtype_name):
    dtype = getattr(torch, dtype_name)
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    base = TinyGPT().to(dev)
    ref = copy.deepcopy(base)
    ours = copy.deepcopy(base).to(dtype)
    if stage == 3:
        ours = zerokern.shard_model(ours, unit_classes=(Block,))
    opt = zerokern.ZeroAdamW(ours.parameters(), lr=1e-3, stage=stage, bucket_numel=257)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    for step in range(10):
        x, y = (t.to(dev) for t in batch(step, rank))
        F.cross_entropy(ours(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(ref(x.to(dev)), y).backward()
        ropt.step()
        ropt.zero_grad()
    full = zerokern.full_state_dict(ours)
    # bf16 model vs fp32 model. ours = bf16(M), M our fp32 master after 10 steps, which started
    # at bf16(P0); the reference R started at P0. bf16 keeps 8 significant bits: a rounding
    # moves x by at most U_BF16 = 2**-8 of |x|, here twice (the start and the end). Both take
    # AdamW steps with the same lr, betas and weight decay, but on gradients of different
    # models (bf16 vs fp32 forward), so the steps themselves may differ as much as AdamW allows:
    # |m^/(sqrt(v^) + eps)| <= B_t at step t (_tol.adamw_step_bound; B_1 = 1, B_10 = 1.043), a
    # move of at most lr * B_t each. With the decay (1 - lr*wd) shrinking any difference:
    #   |M - R| <= U_BF16 |P0| + 2 lr sum_t B_t,   |ours - M| <= U_BF16 |ours|,
    # and |P0| <= |R| (1 - lr*wd)^-10 + lr sum_t B_t, so
    #   |ours - R| <= (2 U_BF16 |R| + (2 + U_BF16) lr sum_t B_t) / (1 - U_BF16)
    #             = 2**-7 * 1.004 |R| + 2.0e-2,
    # plus fp32 roundings (a few 2**-24 per step) and 1e-4 |R| of decay: a factor 1.05 covers
    # them. This bounds what the state dict may hold whatever the two paths did; the float32
    # case is the check that training followed torch's path. (Before: 5e-2, 5e-2.)
    steps_bound = sum(adamw_step_bound(0.9, 0.999, t) for t in range(1, 11))  # = 10.17
    bf16_rtol = 1.05 * 2 * U_BF16 / (1 - U_BF16)
    bf16_atol = 1.05 * (2 + U_BF16) * 1e-3 * steps_bound / (1 - U_BF16)
    for k, v in ref.state_dict().items():
        if dtype == torch.float32:
            torch.testing.assert_close(full[k], v.cpu(), rtol=1e-4, atol=1e-5)
        else:
            torch.testing.assert_close(full[k].float(), v.cpu(), rtol=bf16_rtol, atol=bf16_atol)
    ms = opt.memory_stats()
    assert ms["exp_avg"] > 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_nccl_world1_matches_adamw(stage, dtype_name, tmp_path):
    if not torch.cuda.is_available() or not zerokern.has_cuda_kernels():
        pytest.skip("needs a GPU and the CUDA kernels")
    run_ranks(1, nccl_parity, stage, dtype_name, tmp_path=tmp_path, backend="nccl")


def nccl_guard_and_save(rank, world, stage, out):
    """On CUDA: torch's clip_grad_norm_ as imported before zerokern (it reads the p.grad
    guards: multi-tensor norm, one coefficient read) clips as opt.clip_grad_norm_ does, and
    torch.save of the model's state dict (DLPack-aliased parameters on device memory) loads
    back with plain torch.load to the same values."""
    import io

    from zerokern.zero import interop

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    base = TinyGPT().to(dev).to(torch.bfloat16)
    runs = []
    for form in ("method", "torch"):
        model = copy.deepcopy(base)
        if stage == 3:
            model = zerokern.shard_model(model, unit_classes=(Block,))
        opt = zerokern.ZeroAdamW(model.parameters(), lr=1e-3, stage=stage, bucket_numel=257)
        norms = []
        for step in range(4):
            x, y = (t.to(dev) for t in batch(step, rank))
            F.cross_entropy(model(x).float(), y).backward()
            if form == "method":
                norms.append(float(opt.clip_grad_norm_(0.05)))
            else:
                norms.append(float(interop._TORCH_CLIP(model.parameters(), 0.05)))
            opt.step()
            opt.zero_grad()
        runs.append((model, norms))
    (a, na), (b, nb) = runs
    for u, v in zip(na, nb):
        assert abs(u - v) <= 2e-2 * abs(u), (na, nb)  # bf16 per-parameter norms
    fa, fb = zerokern.full_state_dict(a), zerokern.full_state_dict(b)
    for k in fa:
        torch.testing.assert_close(fa[k].float(), fb[k].float(), rtol=2e-2, atol=2e-3)
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    for k, v in fb.items():
        assert torch.equal(loaded[k].cpu(), v), k


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_nccl_world1_guard_clip_and_plain_save(stage, tmp_path):
    if not torch.cuda.is_available() or not zerokern.has_cuda_kernels():
        pytest.skip("needs a GPU and the CUDA kernels")
    run_ranks(1, nccl_guard_and_save, stage, str(tmp_path), tmp_path=tmp_path,
              backend="nccl")
