"""zerokern.optim.muon: the update of one owned matrix against ``torch.optim.Muon`` itself.

Every comparison is bit for bit (``torch.equal``): the owner runs torch's own operations on
the same inputs, so nothing may differ. That holds for the per-matrix update (torch's own step),
for its fallback copy of torch's step, and, on the CPU, for the batched Newton-Schulz (whose
matrix products are ``bmm``/``baddbmm`` on a stack: measured equal to torch's per-matrix
``mm``/``addmm`` here, which is what these tests check).
"""

from __future__ import annotations

import pytest
import torch

from zerokern.optim import muon as zm
from zerokern.optim.muon import (
    check_muon_params,
    muon_update_,
    muon_update_batched_,
    newton_schulz,
)

SHAPES = [(7, 5), (5, 7), (16, 16), (33, 65), (130, 3), (1, 9)]


def _adjust_fns() -> list[str | None]:
    fns: list[str | None] = [None, "match_rms_adamw"]
    try:  # newer torch only
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))],
                         adjust_lr_fn="spectral_unclamped")
        fns.append("spectral_unclamped")
    except ValueError:
        pass
    return fns


def _hyper(nesterov: bool, adjust_lr_fn: str | None, weight_decay: float) -> dict:
    return dict(lr=0.02, weight_decay=weight_decay, momentum=0.9, nesterov=nesterov,
                adjust_lr_fn=adjust_lr_fn)


def _grads(shape, steps, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(steps)]


def _torch_run(shapes, grads, hyper, dtype, seed=0):
    """torch.optim.Muon on one parameter per shape; the final params and momentum."""
    g = torch.Generator().manual_seed(seed + 1)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    opt = torch.optim.Muon(ps, **hyper)
    for step in range(len(grads[0])):
        for p, gs in zip(ps, grads):
            p.grad = gs[step].clone()
        opt.step()
    return [p.detach() for p in ps], [opt.state[p]["momentum_buffer"] for p in ps]


def _start(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


@pytest.mark.parametrize("fallback", [False, True], ids=["torch-step", "fallback"])
@pytest.mark.parametrize("adjust_lr_fn", _adjust_fns())
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_update_equals_torch_muon_bitwise(fallback, adjust_lr_fn, nesterov, dtype,
                                          monkeypatch):
    if fallback:  # the copy of torch's step used where torch's private one is missing
        monkeypatch.setattr(zm, "_USE_TORCH", False)
    for wd in (0.0, 0.1):
        hyper = _hyper(nesterov, adjust_lr_fn, wd)
        grads = [_grads(s, 3, 10 + i, dtype) for i, s in enumerate(SHAPES)]
        want_p, want_m = _torch_run(SHAPES, grads, hyper, dtype)
        params = _start(SHAPES, dtype)
        bufs = [torch.zeros(s, dtype=dtype) for s in SHAPES]
        for step in range(3):
            for p, m, gs in zip(params, bufs, grads):
                g = gs[step].clone()
                muon_update_(p, g, m, **hyper)
                assert torch.equal(g, gs[step])  # the gradient is only read
        for i in range(len(SHAPES)):
            assert torch.equal(params[i], want_p[i]), (SHAPES[i], wd)
            assert torch.equal(bufs[i], want_m[i]), (SHAPES[i], wd)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, k", [((7, 5), 3), ((5, 7), 2), ((48, 48), 4),
                                      ((65, 130), 3)])
def test_batched_update_equals_torch_muon_bitwise(shape, k, nesterov, dtype):
    hyper = _hyper(nesterov, None, 0.1)
    grads = [_grads(shape, 3, 20 + i, dtype) for i in range(k)]
    want_p, want_m = _torch_run([shape] * k, grads, hyper, dtype)
    params = _start([shape] * k, dtype)
    bufs = torch.zeros((k, *shape), dtype=dtype)  # one block per batch, as OwnerMuon keeps it
    for step in range(3):
        muon_update_batched_(params, [gs[step] for gs in grads], list(bufs), **hyper)
    for i in range(k):
        assert torch.equal(params[i], want_p[i]), i
        assert torch.equal(bufs[i], want_m[i]), i


@pytest.mark.parametrize("shape", [(8, 8), (33, 17), (17, 33), (256, 192), (3, 300)])
def test_batched_newton_schulz_equals_torch_per_matrix(shape):
    g = torch.Generator().manual_seed(3)
    stack = torch.randn((3, *shape), generator=g)
    coeffs = zm.DEFAULT_NS_COEFFICIENTS
    ns = zm._TORCH_NS
    kw = {"use_addmm": zm._addmm(None)} if zm._HAS_ADDMM_FLAG else {}
    want = torch.stack([ns(m, coeffs, 5, 1e-7, **kw) for m in stack])
    got = newton_schulz(stack, coeffs, 5, 1e-7, zm._addmm(None))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_row_blocks_update_as_torch_updates_each_block():
    # A fused (12, 5) QKV weight split per head: each 4-row block is its own Muon matrix,
    # updated as torch.optim.Muon updates the block given as its own parameter.
    hyper = _hyper(True, None, 0.1)
    blocks = [(4, 5)] * 3
    grads = [_grads(s, 2, 30 + i, torch.float32) for i, s in enumerate(blocks)]
    want_p, want_m = _torch_run(blocks, grads, hyper, torch.float32)
    fused = torch.cat(_start(blocks, torch.float32))
    bufs = torch.zeros(12, 5)
    for step in range(2):
        for b in range(3):
            rows = slice(4 * b, 4 * b + 4)
            muon_update_(fused[rows], grads[b][step], bufs[rows], **hyper)
    assert torch.equal(fused, torch.cat(want_p)) and torch.equal(bufs, torch.cat(want_m))


def test_refusals():
    bias = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError) as torch_err:
        torch.optim.Muon([bias])
    with pytest.raises(ValueError) as ours:
        check_muon_params([torch.nn.Parameter(torch.zeros(3, 3)), bias])
    assert str(ours.value) == str(torch_err.value)  # torch's own words
    with pytest.raises(ValueError, match="Adjust learning rate"):
        check_muon_params([torch.nn.Parameter(torch.zeros(3, 3))], adjust_lr_fn="nope")
    p, m = torch.zeros(3, 3), torch.zeros(3, 3)
    with pytest.raises(ValueError, match="param must be a 2-D"):
        muon_update_(torch.zeros(9), torch.zeros(9), torch.zeros(9), lr=0.1,
                     weight_decay=0.0, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="one shape"):
        muon_update_(p, torch.zeros(3, 4), m, lr=0.1, weight_decay=0.0, momentum=0.9,
                     nesterov=True)
    assert not m.any()  # nothing modified
    with pytest.raises(ValueError, match=r"grads\[1\] has shape"):
        muon_update_batched_([p, p], [p, torch.zeros(4, 3)], [m, m], lr=0.1,
                             weight_decay=0.0, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="equally long"):
        muon_update_batched_([p], [], [m], lr=0.1, weight_decay=0.0, momentum=0.9,
                             nesterov=True)
    with pytest.raises(ValueError, match="stack"):
        newton_schulz(torch.zeros(3, 3), (1.0, 1.0, 1.0), 5, 1e-7)
