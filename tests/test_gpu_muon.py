"""zerokern.optim.muon on CUDA against torch.optim.Muon on CUDA: bit for bit.

Marked gpu: skipped without CUDA. The per-matrix update is torch's own step, so it must be
equal on any device; OwnerMuon on one GPU (world size 1, no collectives) likewise.
"""

from __future__ import annotations

import pytest
import torch

from zerokern.optim.muon import muon_update_
from zerokern.optim.owner_muon import OwnerMuon

pytestmark = pytest.mark.gpu

SHAPES = [(7, 5), (64, 48), (48, 64), (1024, 768), (768, 3072)]


def _run(shapes, dtype, hyper, ours: bool):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g, device=dev).to(dtype))
          for s in shapes]
    opt = OwnerMuon(ps, **hyper) if ours else torch.optim.Muon(ps, **hyper)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g, device=dev).to(dtype)
        opt.step()
    return [p.detach() for p in ps]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_owner_muon_one_gpu_equals_torch_muon(dtype, nesterov):
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    want = _run(SHAPES, dtype, hyper, ours=False)
    got = _run(SHAPES, dtype, hyper, ours=True)
    for s, a, b in zip(SHAPES, got, want):
        assert torch.equal(a, b), s


def test_update_on_cuda_views_equals_torch():
    # A block of rows of a bigger matrix (a view), as an owner updates a QKV head.
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    fused = torch.randn(3 * 256, 512, generator=g, device=dev)
    grads = torch.randn(3 * 256, 512, generator=g, device=dev)
    blocks = [torch.nn.Parameter(b.clone()) for b in fused.split(256)]
    opt = torch.optim.Muon(blocks, lr=0.02)
    for b, gb in zip(blocks, grads.split(256)):
        b.grad = gb.clone()
    opt.step()
    buf = torch.zeros_like(fused)
    for i in range(3):
        rows = slice(256 * i, 256 * (i + 1))
        muon_update_(fused[rows], grads[rows], buf[rows], lr=0.02, weight_decay=0.1,
                     momentum=0.95, nesterov=True)
    assert torch.equal(fused, torch.cat([b.detach() for b in blocks]))
