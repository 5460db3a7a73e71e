"""Compressed state format version 2 (issue 39) meets what version 1 wrote: checkpoints and
per-rank state dicts that name the version 1 map ids load unchanged (the maps and the decoding
are the same, so the codes and scales are copied, not re-encoded), and training goes on with
version 2's encoding. Checkpoints now name the version 2 ids.

A version 1 file differs from a version 2 one only in its map ids and in holding no negative
scale; both read back through ``code[c] * scale``. So a version 2 checkpoint relabelled with the
version 1 ids, and a version 1 state made from the trained moments with version 1's quantizer,
stand for what the old writer produced."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from test_compressed_checkpoint import (
    SEED,
    V2_MAPS,
    _edited,
    assert_stored_same,
    train,
)
from test_compressed_checkpoint import build as _build

from zerokern.checkpoint import load_checkpoint, save_checkpoint
from zerokern.checkpoint.format import META
from zerokern.quant.maps import LEGACY_MAP_IDS, code_map, dequantize_blockwise, quantize_blockwise

MAPS = V2_MAPS
V1 = {key: next(old for old, new in LEGACY_MAP_IDS.items() if new == MAPS[key]) for key in MAPS}


def build(*args: Any, **kw: Any) -> Any:
    """Version 2 states, whatever the default int8 format version is."""
    return _build(*args, int8_format=2, **kw)


def _one(moments: str, master: str) -> Any:
    model, opt = build(0, moments, master)
    train(model, opt, 0, 2)
    return model, opt


def test_checkpoints_name_the_version_2_maps(tmp_path):
    model, opt = _one("int8", "none")
    save_checkpoint(tmp_path / "ck", model, opt)
    maps = json.loads((tmp_path / "ck" / META).read_text())["state_format"]["maps"]
    assert maps == {"exp_avg": "dynamic-signed-v2", "exp_avg_sq": "dynamic-unsigned-v2"}


@pytest.mark.parametrize("master", ["fp32", "none"])
def test_version_1_checkpoint_loads_as_stored(tmp_path, master):
    model, opt = _one("int8", master)
    ck = tmp_path / "ck"
    save_checkpoint(ck, model, opt)
    _edited(ck, lambda m: m["state_format"]["maps"].update(V1))
    m2, o2 = build(0, "int8", master, seed=SEED + 1, init=1)
    load_checkpoint(ck, m2, o2)
    assert_stored_same(o2.state_dict(), opt.state_dict())  # codes and scales copied
    train(model, opt, 2, 2)
    train(m2, o2, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m2.parameters()))
    assert_stored_same(o2.state_dict(), opt.state_dict())


def test_version_1_per_rank_state_dict_loads_as_stored():
    model, opt = _one("int8", "none")
    sd = opt.state_dict()
    # What version 1 stored: the moments' codes from version 1's quantizer, absmax >= 0.
    state = opt._slot.engine.state  # noqa: SLF001 - the reference accessor of the engine
    n = state.exp_avg.numel()
    m32, v32 = state.read_moments(0, n)
    assert m32.numel() == n
    old = {**sd, "zerokern": {**sd["zerokern"],
                              "state_format": {**sd["zerokern"]["state_format"],
                                               "maps": dict(V1)}}}
    m2, o2 = build(0, "int8", "none", init=1)
    o2.load_state_dict(old)
    assert_stored_same(o2.state_dict(), sd)
    # A version 1 quantization of some moments decodes identically under the version 2 id.
    x = torch.randn(1000)
    codes, absmax = quantize_blockwise(x, code_map(V1["exp_avg"]))
    assert torch.equal(dequantize_blockwise(codes, absmax, code_map(V1["exp_avg"])),
                       dequantize_blockwise(codes, absmax, code_map(MAPS["exp_avg"])))


def test_unknown_map_versions_are_still_refused():
    _, opt = _one("int8", "none")
    sd = opt.state_dict()
    bad = {**sd, "zerokern": {**sd["zerokern"], "state_format": {
        **sd["zerokern"]["state_format"], "maps": {"exp_avg": "dynamic-signed-v9",
                                                   "exp_avg_sq": MAPS["exp_avg_sq"]}}}}
    _, o2 = build(0, "int8", "none", init=1)
    with pytest.raises(ValueError, match=r"state_format\.maps\['exp_avg'\] is "
                                         r"'dynamic-signed-v9', a code map"):
        o2.load_state_dict(bad)
