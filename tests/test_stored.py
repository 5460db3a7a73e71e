"""The stored-buffer types of issue 36 (zerokern/zero/stored.py) on their own: each format's
read / write / narrow, the int8 store going through requantize_blockwise (a decoded block
comes back bit for bit, which quantize_blockwise alone does not give), and the rank-file
names a checkpoint has always used."""

from __future__ import annotations

import pytest
import torch

from zerokern.quant.maps import SIGNED_MAP_ID, UNSIGNED_MAP_ID, code_map, quantize_blockwise
from zerokern.zero.stored import (
    STORED_PARTS,
    Bf16Stored,
    Fp32Stored,
    Int8Stored,
    stored_type,
)

N = 600  # two whole blocks and a partial one


def _int8(map_id: str = SIGNED_MAP_ID) -> Int8Stored:
    return Int8Stored(torch.zeros(N, dtype=torch.uint8), torch.zeros(3), map_id)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_the_type_is_chosen_from_the_name_once():
    assert [stored_type(f) for f in ("fp32", "bf16", "int8")] == [Fp32Stored, Bf16Stored,
                                                                   Int8Stored]
    assert STORED_PARTS == ("data", "absmax")
    with pytest.raises(ValueError, match="'fp8'"):
        stored_type("fp8")


def test_fp32_and_bf16_store_a_copy_and_a_rounding():
    x = torch.randn(N, generator=torch.Generator().manual_seed(0))
    f = Fp32Stored(torch.zeros(N))
    f.write(x)
    assert torch.equal(f.read(), x) and f.read() is not f.data
    b = Bf16Stored(torch.zeros(N, dtype=torch.bfloat16))
    b.write(x)
    assert torch.equal(b.read(), x.bfloat16().float())  # round to nearest even, widened back
    assert torch.equal(b.narrow(256, 10).read(), x[256:266].bfloat16().float())


def test_int8_write_gives_a_decoded_block_its_codes_back():
    # A block whose largest magnitude is negative: quantize_blockwise of its decoded values
    # shrinks it (the signed map has no -1); the stored type's write must not.
    x = torch.randn(N, generator=torch.Generator().manual_seed(1))
    x[5] = -10.0
    s = _int8()
    s.write(x)
    decoded = s.read()
    codes, absmax = s.data.clone(), s.absmax.clone()
    once = quantize_blockwise(decoded, code_map(SIGNED_MAP_ID))
    assert not torch.equal(once[1], absmax)  # the naive path would change the state
    s.write(decoded)
    assert torch.equal(_bits(s.read()), _bits(decoded))
    assert torch.equal(s.data, codes) and torch.equal(s.absmax, absmax)


def test_int8_narrow_is_a_view_on_its_blocks():
    s = _int8(UNSIGNED_MAP_ID)
    x = torch.rand(N, generator=torch.Generator().manual_seed(2))
    s.narrow(256, N - 256).write(x[256:])
    assert torch.equal(s.data[:256], torch.zeros(256, dtype=torch.uint8))
    assert torch.equal(_bits(s.read()[256:]), _bits(s.narrow(256, N - 256).read()))
    assert s.absmax[0] == 0 and bool((s.absmax[1:] > 0).all())
    with pytest.raises(AssertionError, match="block"):
        s.narrow(100, 10)
    s.zero_()
    assert not s.data.any() and not s.absmax.any()


def test_checkpoint_names_are_the_ones_checkpoints_use():
    assert Fp32Stored.file_tensors("exp_avg") == {"data": ("exp_avg.fp32", torch.float32)}
    assert Bf16Stored.file_tensors("exp_avg_sq") == {"data": ("exp_avg_sq.bf16",
                                                              torch.bfloat16)}
    assert Int8Stored.file_tensors("exp_avg") == {"data": ("exp_avg.int8", torch.uint8),
                                                  "absmax": ("exp_avg.absmax", torch.float32)}
    assert [Int8Stored.scale_count(n) for n in (0, 1, 256, 257)] == [0, 1, 1, 2]
    assert Bf16Stored.scale_count(1000) == 0
