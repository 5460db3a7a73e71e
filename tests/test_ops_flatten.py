"""flatten_into_ / unflatten_from_: exact round trips on every CPU backend."""

import re

import pytest
import torch

from zerokern import ops
from zerokern.ops._backend import available_backends

# The sizes above the kernels' thresholds run their OpenMP split: on two threads, as the
# split is what they test (conftest.py runs the other in-process tests on one).
pytestmark = pytest.mark.usefixtures("two_threads")
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


# --- many small tensors, partial ranges, zero-length pieces (the native path's pointer math) ---


def _pieces(dtype, seed):
    """300 tensors of 0..40 elements, each with a random range (often partial, sometimes empty),
    their slots scattered over a flat buffer in a shuffled order with gaps between them."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 41, (300,), generator=g).tolist()
    ts = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    ranges = []
    for n in sizes:
        s = int(torch.randint(0, n + 1, (1,), generator=g))
        ranges.append((s, int(torch.randint(0, n - s + 1, (1,), generator=g))))
    order = torch.randperm(len(ts), generator=g).tolist()
    offsets, pos = [0] * len(ts), 0
    for i in order:
        pos += int(torch.randint(0, 3, (1,), generator=g))  # gaps, including none
        offsets[i] = pos
        pos += ranges[i][1]
    return ts, ranges, offsets, pos + 4


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_many_small_packed_against_cat(backend, dtype):
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(n, generator=g).to(dtype) for n in [1024] * 200 + [0, 1, 3, 0, 5]]
    ref = torch.cat(ts)
    flat = torch.full((ref.numel(),), -1.0, dtype=dtype)
    assert ops.flatten_into_(ts, flat, backend=backend) is flat
    assert torch.equal(flat.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       ref.view(torch.int16 if dtype != torch.float32 else torch.int32))
    back = [torch.full_like(t, -1.0) for t in ts]
    got = ops.unflatten_from_(ref, back, backend=backend)
    assert len(got) == len(back) and all(a is b for a, b in zip(got, back))
    assert all(torch.equal(a, b) for a, b in zip(ts, back))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_partial_ranges_scattered_offsets_against_cat(backend, seed):
    ts, ranges, offsets, total = _pieces(torch.bfloat16, seed)
    flat = torch.full((total,), -3.0, dtype=torch.bfloat16)
    ops.flatten_into_(ts, flat, offsets, ranges=ranges, backend=backend)
    expect = torch.full((total,), -3.0, dtype=torch.bfloat16)
    for t, (s, n), o in zip(ts, ranges, offsets):
        expect[o:o + n] = t[s:s + n]
    assert torch.equal(flat, expect)
    # Inverse: only each tensor's range is written, the rest keeps its value.
    src = torch.randn(total).to(torch.bfloat16)
    back = [torch.full_like(t, 9.0) for t in ts]
    ops.unflatten_from_(src, back, offsets, ranges=ranges, backend=backend)
    for t, b, (s, n), o in zip(ts, back, ranges, offsets):
        want = torch.full_like(t, 9.0)
        want[s:s + n] = src[o:o + n]
        assert torch.equal(b, want)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_views_with_storage_offset_and_tuple_input(backend):
    base = torch.arange(40.0)
    a, b = base[3:10], base[20:32].view(3, 4)  # contiguous views that do not start at 0
    flat = torch.zeros(19)
    ops.flatten_into_((a, b), flat, backend=backend)
    assert torch.equal(flat, torch.cat([a, b.reshape(-1)]))
    ops.unflatten_from_(torch.arange(100.0, 119.0), (a, b), backend=backend)
    assert torch.equal(base[3:10], torch.arange(100.0, 107.0))
    assert torch.equal(base[20:32], torch.arange(107.0, 119.0))
    assert torch.equal(base[10:20], torch.arange(10.0, 20.0))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_and_zero_length_pieces_do_not_overlap(backend):
    out = torch.full((4,), 2.0)
    ops.flatten_into_([], out, backend=backend)
    ops.flatten_into_([torch.zeros(0), torch.ones(4), torch.zeros(3)], out, [0, 0, 4],
                      ranges=[(0, 0), (0, 4), (3, 0)], backend=backend)
    assert torch.equal(out, torch.ones(4))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_version_counters_bumped_like_an_inplace_op(backend):
    out, t = torch.zeros(4), torch.ones(4)
    v_out, v_t = out._version, t._version
    ops.flatten_into_([t], out, backend=backend)
    assert out._version > v_out and t._version == v_t
    ops.unflatten_from_(out, [t], backend=backend)
    assert t._version > v_t


# --- argument checks: the native entry (_C.copy_flat) and the Python _plan say the same ---

_BAD = [
    # (tensors, offsets, ranges, out numel, exception, the argument the message must name)
    ([torch.zeros(2), 3], None, None, 8, TypeError,
     r"tensors\[1\] must be a torch\.Tensor, got int"),
    ([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], None, None, 8, TypeError,
     r"tensors\[1\] has dtype torch\.float64, {name} has torch\.float32"),
    ([torch.zeros(4, device="meta")], None, None, 8, ValueError, r"tensors\[0\] is on meta"),
    ([torch.zeros(2), torch.zeros(4, 4).t()], None, None, 32, ValueError,
     r"tensors\[1\] must be contiguous"),
    ([torch.zeros(4)], None, [(0, 1), (0, 1)], 8, ValueError, r"ranges has 2 entries for 1"),
    ([torch.zeros(4)], None, [(2, 3)], 8, ValueError, r"ranges\[0\] = \(2, 3\) is outside"),
    ([torch.zeros(4)], None, [(-1, 1)], 8, ValueError, r"ranges\[0\] = \(-1, 1\)"),
    ([torch.zeros(4), torch.zeros(4)], None, [(0, 4), (1, -1)], 8, ValueError, r"ranges\[1\]"),
    ([torch.zeros(4)], [0, 4], None, 8, ValueError, r"offsets has 2 entries for 1"),
    ([torch.zeros(4)], [7], None, 8, ValueError,
     r"offsets\[0\] = 7 with 4 elements does not fit in {name} \(8 elements\)"),
    ([torch.zeros(4)], [-1], None, 8, ValueError, r"offsets\[0\] = -1"),
    ([torch.zeros(5), torch.zeros(5)], None, None, 8, ValueError, r"offsets\[1\] = 5 with 5"),
    ([torch.zeros(2), torch.zeros(3), torch.zeros(1)], [5, 0, 2], None, 8, ValueError,
     r"offsets overlap in {name}: tensors\[1\] and tensors\[2\]"),
    (torch.zeros(4), None, None, 8, TypeError, r"tensors must be a sequence"),
]


def _refused(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    raise AssertionError("not refused")


@pytest.mark.parametrize("case", range(len(_BAD)))
def test_bad_input_same_error_on_every_backend_and_nothing_written(case):
    tensors, offsets, ranges, n, exc, pattern = _BAD[case]
    inputs = [] if isinstance(tensors, torch.Tensor) else [
        t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    before = [t.clone() for t in inputs]
    seen = set()
    for backend in CPU_BACKENDS:
        kw = dict(ranges=ranges, backend=backend)
        out = torch.full((n,), 3.0)
        got = _refused(ops.flatten_into_, tensors, out, offsets, **kw)
        assert got[0] is exc and re.search(pattern.format(name="out"), got[1]), (backend, got)
        assert torch.equal(out, torch.full((n,), 3.0))
        seen.add(("out", got))
        flat = torch.full((n,), 5.0)
        got = _refused(ops.unflatten_from_, flat, tensors, offsets, **kw)
        assert got[0] is exc and re.search(pattern.format(name="flat"), got[1]), (backend, got)
        assert all(torch.equal(a, b) for a, b in zip(before, inputs))
        seen.add(("flat", got))
    assert len(seen) == 2  # one message per direction, whichever backend checked it


def test_native_entry_checks_on_direct_call():
    from zerokern import _native

    if not _native.has_native():
        pytest.skip("native module not built")
    out = torch.full((8,), 3.0)
    with pytest.raises(ValueError, match=r"offsets\[0\] = 7 with 4 elements does not fit in out"):
        _native._C.copy_flat([torch.zeros(4)], out, "out", [7], None, None, True)
    with pytest.raises(TypeError, match=r"tensors\[0\] must be a torch\.Tensor, got str"):
        _native._C.copy_flat(["x"], out, "out", None, None, None, True)
    assert torch.equal(out, torch.full((8,), 3.0))


def test_torch_compile_traces_the_custom_ops():
    # Under torch.compile the public op goes through the custom ops (not the direct native
    # call), whose native implementation is the same _C.copy_flat.
    ts, out = [torch.randn(5), torch.randn(3, 3)], torch.zeros(20)
    ref = torch.zeros(20)
    ref[0:5], ref[6:15] = ts[0], ts[1].reshape(-1)

    def f(ts, out):
        ops.flatten_into_(ts, out, [0, 6], ranges=[(0, 5), (0, 9)])
        return out * 2

    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(ts, out), ref * 2)
    assert torch.equal(out, ref)
    back = [torch.zeros(5), torch.zeros(3, 3)]

    def g(flat, back):
        ops.unflatten_from_(flat, back, [0, 6], ranges=[(0, 5), (0, 9)])
        return back[0] + 1

    assert torch.equal(torch.compile(g, backend="aot_eager", fullgraph=True)(ref, back), ts[0] + 1)
    assert torch.equal(back[0], ts[0]) and torch.equal(back[1], ts[1])


def test_dispatch_modes_and_fake_tensors_see_the_custom_op():
    # The direct native call would bypass them: a mode on the stack or a tensor subclass
    # (FakeTensor here) takes the custom-op path instead.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    ts, out = [torch.randn(3), torch.randn(2)], torch.zeros(5)
    with Seen() as mode:
        ops.flatten_into_(ts, out)
    assert any("zerokern.flatten_into_" in name for name in mode.ops), mode.ops
    assert torch.equal(out, torch.cat(ts))
    with FakeTensorMode() as fake_mode:
        fts, fout = [torch.empty(3), torch.empty(2)], torch.empty(5)
    ops.flatten_into_(fts, fout, backend="cpu")  # fake tensors, no mode: the subclass check
    ops.unflatten_from_(fout, fts, backend="cpu")
    assert fake_mode is not None
