"""flatten_into_ / unflatten_from_: exact round trips on every CPU backend."""

import pytest
import torch

from zerokern import ops
from zerokern.ops._backend import available_backends

CPU_BACKENDS = [b for b in available_backends("cpu") if b != "triton"]
SHAPES = [(1,), (7,), (3, 5), (4099,), (2, 3, 7), (65539,), (0,), (513, 1031)]


def tensors(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_packed(backend, dtype):
    ts = tensors(dtype)
    total = sum(t.numel() for t in ts)
    flat = torch.full((total + 5,), -7.0, dtype=dtype)
    ops.flatten_into_(ts, flat, backend=backend)
    assert torch.equal(flat[:total], torch.cat([t.reshape(-1) for t in ts]))
    assert torch.equal(flat[total:], torch.full((5,), -7.0, dtype=dtype))
    back = [torch.empty_like(t) for t in ts]
    ops.unflatten_from_(flat, back, backend=backend)
    for a, b in zip(ts, back):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_split_across_two_buckets_and_offsets(backend, dtype):
    big = torch.randn(3001).to(dtype)
    small = torch.randn(17).to(dtype)
    b0, b1 = torch.zeros(2048, dtype=dtype), torch.zeros(2048, dtype=dtype)
    # bucket 0: small at 3, then big[0:2000] at 48; bucket 1: big[2000:3001] at 0
    ops.flatten_into_([small, big], b0, [3, 48], ranges=[(0, 17), (0, 2000)], backend=backend)
    ops.flatten_into_([big], b1, [0], ranges=[(2000, 1001)], backend=backend)
    assert torch.equal(b0[3:20], small) and torch.equal(b0[48:2048], big[:2000])
    assert torch.equal(b1[:1001], big[2000:])
    assert torch.count_nonzero(b0[:3]) == 0 and torch.count_nonzero(b0[20:48]) == 0
    out = torch.zeros_like(big)
    ops.unflatten_from_(b0, [out], [48], ranges=[(0, 2000)], backend=backend)
    ops.unflatten_from_(b1, [out], [0], ranges=[(2000, 1001)], backend=backend)
    assert torch.equal(out, big)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_large_bucket_parallel_path(backend):
    ts = [torch.randn(n) for n in (1 << 19, 12345, 1 << 18)]
    flat = torch.empty(sum(t.numel() for t in ts))
    ops.flatten_into_(ts, flat, backend=backend)
    assert torch.equal(flat, torch.cat(ts))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(tensors=[torch.zeros(4, dtype=torch.bfloat16)]), TypeError, "tensors\\[0\\]"),
        (dict(tensors=[torch.zeros(4, 4).t()]), ValueError, "contiguous"),
        (dict(tensors=[torch.zeros(4)], offsets=[7]), ValueError, "offsets\\[0\\]"),
        (dict(tensors=[torch.zeros(4), torch.zeros(4)], offsets=[0, 2]), ValueError, "overlap"),
        (dict(tensors=[torch.zeros(4)], ranges=[(2, 3)]), ValueError, "ranges\\[0\\]"),
        (dict(tensors=torch.zeros(4)), TypeError, "tensors"),
    ],
)
def test_bad_input_writes_nothing(kwargs, exc, match):
    out = torch.full((8,), 3.0)
    with pytest.raises(exc, match=match):
        ops.flatten_into_(out=out, **kwargs)
    assert torch.equal(out, torch.full((8,), 3.0))


def test_opcheck():
    ts = [torch.randn(5), torch.randn(3, 3)]
    out = torch.zeros(20)
    torch.library.opcheck(
        torch.ops.zerokern.flatten_into_.default, (ts, out, [0, 6], [0, 0], [5, 9], CPU_BACKENDS[0])
    )
