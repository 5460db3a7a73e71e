"""The compiled Triton block quantization kernels (zerokern/kernels/triton/comm_quant.py) on a
CUDA device against the oracle (zerokern/quant/comm_codec.py) on CPU copies: payload bytes
equal, decoded values (concatenated and reduced, into fp32/bf16/fp16) the same bits, NaN
included (the kernels write the canonical NaN of each dtype, as the oracle does).

Inputs: every dtype and code width, blocks of 16, 256 and 8192, odd sizes and several
segments, the adversarial blocks of test_comm_quant.py (ties, subnormal and underflowing
scales, fp32's largest values), inf/NaN blocks, and a tensor past 2**31 elements (the int64
offsets). The automatic backend on CUDA is the Triton one. Every test carries the ``gpu``
marker (conftest.py skips it without CUDA).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_comm_quant import _adversarial_blocks

from zerokern.ops import dequantize_blocks_, quantize_blocks_
from zerokern.quant import comm_codec as cc

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _same(x: torch.Tensor, segments: int, bits: int, block: int, what: str = "") -> None:
    pytest.importorskip("triton")
    n = x.numel() // segments
    ref = cc.quantize(x, segments, bits, block)
    got = torch.full(ref.shape, 0xAB, dtype=torch.uint8, device="cuda")
    quantize_blocks_(x.cuda(), got, segments=segments, bits=bits, block=block)
    bad = (got.cpu() != ref).nonzero().flatten()[:8].tolist()
    assert not bad, f"{what}: payload bytes differ at {bad}"
    for od in DTYPES:
        for reduce in (False, True):
            want = cc.dequantize(ref, n, segments, bits, block, reduce=reduce, dtype=od)
            out = torch.empty(want.shape, dtype=od, device="cuda")
            dequantize_blocks_(ref.cuda(), out, segments=segments, bits=bits, block=block,
                               reduce=reduce)
            diff = (_bits(out.cpu()) != _bits(want)).nonzero().flatten()[:8].tolist()
            assert not diff, f"{what}: out {od} reduce={reduce} differs at {diff}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block,n,segments", [(16, 37, 3), (16, 4099, 2), (256, 1, 1),
                                               (256, 100_003, 4), (8192, 8195, 3)])
def test_random_bitwise(dtype, bits, block, n, segments):
    g = torch.Generator().manual_seed(n)
    mags = torch.logspace(-6, 6, n * segments)[torch.randperm(n * segments, generator=g)]
    x = (torch.randn(n * segments, generator=g) * mags).to(dtype)
    _same(x, segments, bits, block, f"{dtype} n={n}")


@pytest.mark.parametrize("bits", [8, 4])
def test_adversarial_and_nonfinite_blocks(bits):
    for name, blk in _adversarial_blocks(16, cc.LEVELS[bits]).items():
        _same(blk.float(), 1, bits, 16, name)
        _same(torch.cat([blk[:13], -blk[:13]]).float(), 2, bits, 16, name)
    for dt in DTYPES:
        for bad in (math.inf, -math.inf, math.nan):
            x = torch.randn(3 * 53, generator=torch.Generator().manual_seed(1)).to(dt)
            x[53 + 20] = bad
            x[5] = bad
            _same(x, 3, bits, 16, f"{bad} {dt}")


def test_past_2_31_elements():
    """The int64 offsets: a bf16 tensor of 2**31 + 4099 elements, 4-bit codes. The blocks of
    its tail, checked against the oracle run on that tail alone (blocks start at block
    multiples, so the tail's payload is a slice of the whole one)."""
    pytest.importorskip("triton")
    n, block, bits = 2**31 + 4099, 256, 4
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    payload = torch.empty(cc.payload_nbytes(n, bits, block), dtype=torch.uint8, device="cuda")
    quantize_blocks_(x, payload, bits=bits, block=block)
    nb = cc.num_blocks(n, block)
    start = (n // block - 40) * block  # 40 full blocks and the partial one
    tail = x[start:].cpu()
    ref = cc.quantize(tail, 1, bits, block)
    tnb = cc.num_blocks(tail.numel(), block)
    assert torch.equal(payload[4 * (nb - tnb): 4 * nb].cpu(), ref[: 4 * tnb])
    codes = payload[4 * nb + start // 2:].cpu()
    assert torch.equal(codes, ref[4 * tnb: 4 * tnb + codes.numel()])
    out = torch.empty(n, dtype=torch.float32, device="cuda")
    dequantize_blocks_(payload, out, bits=bits, block=block)
    want = cc.dequantize(ref, tail.numel(), 1, bits, block)
    assert torch.equal(_bits(out[start:].cpu()), _bits(want))
