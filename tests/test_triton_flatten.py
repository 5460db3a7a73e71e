"""The bucket copy Triton kernel (copy_segments, zerokern/kernels/triton/flatten.py) under the
Triton interpreter, without a GPU: round trips through padded, unaligned buckets with a tensor
split across two of them, views of one tensor, and raw bytes at every alignment, never writing
outside a segment; every access width of the kernel is exercised.

The checks run in a subprocess with TRITON_INTERPRET=1 (see triton_common.py); the test below
asserts on the failures and case counts it reports.
"""

from __future__ import annotations

import pytest
import triton_common
from triton_common import Group, assert_group
from triton_common import start_scripts as start_scripts  # conftest starts the subprocess

# ----------------------------------------------------------------------------------------
# Script side: run under the interpreter by triton_common
# ----------------------------------------------------------------------------------------


def _interp_flatten(out):
    import torch

    from zerokern.kernels.triton import flatten as kf

    grp = Group()
    widths: set[int] = set()
    sentinel = -7

    def round_trip(name, srcs, pad_elems):
        """Pack srcs back to back into two buckets (the largest tensor split across them),
        optionally padding each offset to pad_elems; scatter back into fresh tensors."""
        dt = srcs[0].dtype
        big = max(range(len(srcs)), key=lambda i: srcs[i].numel())
        split = srcs[big].numel() // 3 + 1
        pieces = []  # (src view, bucket index)
        for i, t in enumerate(srcs):
            if i == big:
                pieces += [(t[:split], 0), (t[split:], 1)]
            else:
                pieces.append((t, 0 if i < big else 1))

        def pad(o):
            return -(-o // pad_elems) * pad_elems

        offsets, sizes = [], [1, 1]  # start each bucket 1 element in: unaligned for odd pads
        for t, b in pieces:
            o = pad(sizes[b])
            offsets.append(o)
            sizes[b] = o + t.numel()
        buckets = [torch.full((sz + 3,), sentinel, dtype=dt) for sz in sizes]
        segs = [(t, buckets[b][o : o + t.numel()]) for (t, b), o in zip(pieces, offsets)]
        outs = [torch.empty_like(t) for t in srcs]
        back = []
        for i, t in enumerate(outs):
            if i == big:
                back += [t[:split], t[split:]]
            else:
                back.append(t)
        back_segs = [(d, o) for (_, d), o in zip(segs, back)]

        def chk():
            table = kf.build_table(segs) + kf.build_table(back_segs)
            widths.update(table[3 :: kf.ROW])
            kf.copy_segments_triton(segs)
            covered = [torch.zeros(b.numel(), dtype=torch.bool) for b in buckets]
            for (t, b), o in zip(pieces, offsets):
                assert torch.equal(buckets[b][o : o + t.numel()], t), "bucket content"
                covered[b][o : o + t.numel()] = True
            for b, c in zip(buckets, covered):
                assert bool((b[~c] == sentinel).all()), "copy wrote outside its segment"
            kf.copy_segments_triton(back_segs)
            for t, o in zip(srcs, outs):
                assert torch.equal(t, o), "round trip"

        grp.check(name, chk)

    for dt in (torch.float32, torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(0)
        srcs = [torch.randn(n, generator=gen).to(dt) for n in (1, 7, 4099, 65539, 3)]
        for pad in (1, 16 // srcs[0].element_size()):
            round_trip(f"{dt} pad={pad}", srcs, pad)
        # sub-ranges of one tensor at odd offsets on both sides
        base = torch.randn(5000, generator=gen).to(dt)
        round_trip(f"{dt} views of one tensor", [base[1:4000], base[4001:4002], base[4003:]], 1)

    # Raw bytes, any alignment: equal misalignment mod 16 (head + 16-byte body + tail),
    # different misalignment (byte path), empty segments and an empty list.
    u = torch.randint(0, 256, (70000,), dtype=torch.uint8, generator=torch.Generator())
    dst = torch.zeros(140000, dtype=torch.uint8)
    segs = [
        (u[3:66000], dst[19:66016]),  # 3 == 19 mod 16
        (u[5:1000], dst[70002:70997]),  # 5 vs 2 mod 16
        (u[7:7], dst[80000:80000]),
        (u[0:1], dst[90001:90002]),
        (u[100:117], dst[100000:100017]),  # aligned start, 17 bytes
    ]

    def raw():
        widths.update(kf.build_table(segs)[3 :: kf.ROW])
        kf.copy_segments_triton(segs)
        kf.copy_segments_triton([])
        for s, d in segs:
            assert torch.equal(s, d)
        mask = torch.ones(dst.numel(), dtype=torch.bool)
        for _, d in segs:
            off = d.data_ptr() - dst.data_ptr()
            mask[off : off + d.numel()] = False
        assert bool((dst[mask] == 0).all()), "copy wrote outside its segment"

    grp.check("raw bytes", raw)
    out["flatten"] = grp.result()
    out["flatten_widths"] = sorted(int(w) for w in widths)




CHECKS = {"interp": (("flatten", _interp_flatten),)}


# ----------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interp():
    return triton_common.results("interp", __file__)


def test_copy_segments(interp):
    assert_group(interp, "flatten", 10)
    # Every access width of the copy kernel was exercised.
    assert interp["flatten_widths"] == [1, 2, 4, 16], interp["flatten_widths"]
    print("interpreter seconds:", interp["seconds"])
