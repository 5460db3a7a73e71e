"""The block quantization Triton kernels (zerokern/kernels/triton/comm_quant.py) without a GPU.

Interpreter (TRITON_INTERPRET=1): the payload bytes of ``quantize_triton_`` and the values of
``dequantize_triton_`` (concatenated and reduced, into fp32, bf16 and fp16) equal the oracle
(zerokern/quant/comm_codec.py) bit for bit: every dtype and code width, blocks of 16, 256 and
8192, odd sizes and several segments, tiles of many blocks and of few (TILE patched), the
adversarial blocks of test_comm_quant.py, and inf/NaN blocks (canonical NaN bits). The payload
starts filled with 0xAB, so a byte the kernel forgot to write shows.

Compile (sm_90, GPUTarget("cuda", 90, 32), only ptxas needed): every variant produces a cubin
without spills, divides with IEEE ``div.rn.f32`` (no approximate division), contracts nothing
into an fma (the reduce's ``q * s`` and its add round separately, as in the oracle) and flushes
nothing to zero.

The checks run in subprocesses (see triton_common.py); the tests assert on what they report.
"""

from __future__ import annotations

import pytest
import triton_common
from triton_common import Group, assert_group
from triton_common import bits as _bits
from triton_common import start_scripts as start_scripts  # conftest starts the subprocess

# ----------------------------------------------------------------------------------------
# Script side: run under the interpreter by triton_common
# ----------------------------------------------------------------------------------------


def _interp_codec(out):
    import math

    import torch
    from test_comm_quant import _adversarial_blocks

    from zerokern.kernels.triton import comm_quant as kq
    from zerokern.ops import dequantize_blocks_, quantize_blocks_
    from zerokern.quant import comm_codec as cc

    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    grp, special = Group(), Group()

    def same(x, segments, bits, block, grp=grp, name=""):
        def chk():
            n = x.numel() // segments
            ref = cc.quantize(x, segments, bits, block)
            got = torch.full_like(ref, 0xAB)
            kq.quantize_triton_(x, got, segments, bits, block)
            bad = (got != ref).nonzero().flatten()[:8].tolist()
            assert not bad, f"payload bytes differ at {bad}"
            for od in dtypes:
                for reduce in (False, True):
                    want = cc.dequantize(ref, n, segments, bits, block, reduce=reduce, dtype=od)
                    o = torch.empty(want.numel(), dtype=od)
                    kq.dequantize_triton_(ref, o, segments, bits, block, reduce)
                    diff = (_bits(o) != _bits(want)).nonzero().flatten()[:8].tolist()
                    assert not diff, f"out {od} reduce={reduce} differs at {diff}"

        grp.check(f"{name} {x.dtype} n={x.numel()} segs={segments} bits={bits} "
                  f"block={block}", chk)

    g = torch.Generator().manual_seed(0)
    for dt in dtypes:
        for bits in (8, 4):
            for block, sizes in ((16, ((1, 1), (37, 3), (4099, 1), (16, 4))),
                                 (256, ((513, 2), (1000, 4), (256, 1))),
                                 (8192, ((8195, 1),))):
                for n, segs in sizes:
                    if dt != torch.float32 and n * segs > 2000:
                        continue  # the large sizes once (the interpreter is slow)
                    mags = torch.logspace(-5, 5, n * segs)[torch.randperm(n * segs, generator=g)]
                    x = (torch.randn(n * segs, generator=g) * mags).to(dt)
                    same(x, segs, bits, block)
    # Few blocks per tile: many programs, the tile's last rows beyond the segment.
    saved = kq.TILE
    try:
        for tile in (16, 64):
            kq.TILE = tile
            for bits in (8, 4):
                x = torch.randn(3 * 101, generator=g)
                same(x, 3, bits, 16, name=f"TILE={tile}")
    finally:
        kq.TILE = saved
    for bits in (8, 4):
        for name, blk in _adversarial_blocks(16, cc.LEVELS[bits]).items():
            same(blk.float(), 1, bits, 16, special, name)
            same(torch.cat([blk[:13], -blk[:13]]).float(), 2, bits, 16, special, name)
        for dt in dtypes:
            for bad in (math.inf, -math.inf, math.nan):
                x = torch.randn(2 * 53, generator=g).to(dt)
                x[53 + 20] = bad
                x[5] = bad if bad != bad else -bad
                same(x, 2, bits, 16, special, f"{bad} in two blocks")
    # Through the op (its dispatch to the kernel).
    x = torch.randn(3 * 70, generator=g).to(torch.bfloat16)

    def via_op():
        p = torch.empty(3 * cc.payload_nbytes(70, 4, 32), dtype=torch.uint8)
        quantize_blocks_(x, p, segments=3, bits=4, block=32, backend="triton")
        assert torch.equal(p, cc.quantize(x, 3, 4, 32))
        o = torch.empty(70, dtype=torch.float16)
        dequantize_blocks_(p, o, segments=3, bits=4, block=32, reduce=True, backend="triton")
        want = cc.dequantize(p, 70, 3, 4, 32, reduce=True, dtype=torch.float16)
        assert torch.equal(_bits(o), _bits(want))

    grp.check("through the ops", via_op)
    out["codec"], out["codec_special"] = grp.result(), special.result()


# ----------------------------------------------------------------------------------------
# Script side: sm_90 codegen, without the interpreter
# ----------------------------------------------------------------------------------------


def _compiler_missing():
    """Why sm_90 code cannot be generated here, or None (test_triton_compile's probe)."""
    import os

    import triton

    if "nvidia" not in triton.backends.backends:
        return "triton has no nvidia backend"
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except (ImportError, AttributeError, TypeError):
        return None  # another triton version: let the compile itself tell
    except Exception as e:  # noqa: BLE001 - knobs raise when ptxas cannot be found
        return f"ptxas for sm_90 unavailable: {e!r}"[:500]
    return None if os.path.exists(ptxas) else f"ptxas not found at {ptxas}"


def _compile_codec(out):
    from test_triton_compile import _compile_one

    why = _compiler_missing()
    if why is not None:
        out["skip"] = why
        return
    from zerokern.kernels.triton import comm_quant as kq

    assert not kq._INTERPRETED
    kernels = {}
    tdt = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
    for dt in tdt:
        for bits in (8, 4):
            for block, i64 in ((256, False), (16, False), (8192, False), (256, True)):
                sig = {"x_ptr": f"*{dt}", "scales_ptr": "*fp32", "codes_ptr": "*u8",
                       "n": "i64" if i64 else "i32", "nb": "i32",
                       "seg_bytes": "i64" if i64 else "i32",
                       **{c: "constexpr" for c in ("BLOCK", "ROWS", "BITS", "L", "USE_INT64",
                                                   "SOFT_FP")}}
                cx = dict(BLOCK=block, ROWS=max(1, kq.TILE // block), BITS=bits,
                          L=127 if bits == 8 else 7, USE_INT64=i64, SOFT_FP=False)
                kernels[f"quantize x={dt} bits={bits} block={block} int64={i64}"] = _compile_one(
                    kq.quantize_kernel, sig, cx, dict(kq.COMPILE_OPTIONS),
                    ("x_ptr", "scales_ptr", "codes_ptr"))
    for od in tdt:
        for bits in (8, 4):
            for reduce in (False, True):
                for block, i64 in ((256, False), (16, False), (256, True)):
                    sig = {"scales_ptr": "*fp32", "codes_ptr": "*u8", "out_ptr": f"*{od}",
                           "n": "i64" if i64 else "i32", "nb": "i32",
                           "seg_bytes": "i64" if i64 else "i32", "segments": "i32",
                           **{c: "constexpr" for c in ("BLOCK", "ROWS", "BITS", "REDUCE",
                                                       "NAN_BITS", "USE_INT64", "SOFT_FP")}}
                    cx = dict(BLOCK=block, ROWS=max(1, kq.TILE // block), BITS=bits,
                              REDUCE=reduce, NAN_BITS={"bf16": 0x7FC0, "fp16": 0x7E00}.get(od, 0),
                              USE_INT64=i64, SOFT_FP=False)
                    name = f"dequantize out={od} bits={bits} reduce={reduce} block={block} " \
                           f"int64={i64}"
                    kernels[name] = _compile_one(kq.dequantize_kernel, sig, cx,
                                                 dict(kq.COMPILE_OPTIONS),
                                                 ("scales_ptr", "codes_ptr", "out_ptr"))
    out["kernels"] = kernels
    out["tile"], out["num_warps"] = kq.TILE, kq.NUM_WARPS


CHECKS = {"interp": (("codec", _interp_codec),), "compile": (("compile", _compile_codec),)}


# ----------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interp():
    return triton_common.results("interp", __file__)


@pytest.fixture(scope="module")
def compiled():
    return triton_common.results("compile", __file__)


def test_triton_equals_oracle_bitwise(interp):
    assert_group(interp, "codec", 2 * 8 + 2 * 2 * 5 + 4 + 1)


def test_triton_adversarial_and_nonfinite_blocks(interp):
    assert_group(interp, "codec_special", 2 * (2 * 13 + 3 * 3))


def test_compile_sm90(compiled):
    kernels = compiled["kernels"]
    assert len(kernels) == 3 * 2 * 4 + 3 * 2 * 2 * 3
    lines = []
    for name, k in kernels.items():
        ptx = {p: c for p, c in k["ptx"].items() if c}
        lines.append(f"{name}: ptx {ptx} res {k['resources']} smem {k['shared']}")
        assert k["cubin_bytes"] > 0 and k["sm_90"], (name, k["asm"])
        if k["resources"] is not None:
            assert k["resources"]["local"] == 0, f"{name} spills: {k['resources']}"
        for bad in ("fma.rn.f32", "div.full", "div.approx", ".ftz", ".f64", "mul.f32",
                    "add.f32", "sub.f32"):
            assert not ptx.get(bad), (name, bad, ptx)
        block = int(name.split("block=")[1].split()[0])
        per = max(compiled["tile"], block) // (32 * compiled["num_warps"])  # per thread
        if name.startswith("quantize"):
            # x / s per element and s = a / L per block, IEEE; the rounding to an integer is
            # two adds per element, (t + 1.5 * 2**23) - 1.5 * 2**23, neither folded away
            assert ptx.get("div.rn.f32", 0) > per, (name, ptx)
            assert ptx.get("add.rn.f32", 0) == 2 * per, (name, ptx)
        else:
            # q * s per element (and per element of the second and later segments), rounded
            # on its own; the reduce's add into the fp32 sum too
            reduce = "reduce=True" in name
            assert ptx.get("mul.rn.f32", 0) == (2 if reduce else 1) * per, (name, ptx)
            assert ptx.get("add.rn.f32", 0) == (per if reduce else 0), (name, ptx)
            if "out=bf16" in name:
                assert ptx.get("cvt.rn.bf16.f32"), (name, ptx)
    print("\n".join(lines))
