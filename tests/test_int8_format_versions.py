"""int8 format versions 2 and 3 (issue 39) across loads, in one process: a state saved in one
version and loaded into an optimizer of the other (checkpoint or per-rank state dict) is
converted: decoded on the saved maps, stored by the loading version's quantizer, so bit for
bit what storing the saved fp32 values in that version gives and within that version's error
bound of them; it then steps in the loading version. The resumed run is compared with the same
state loaded through torch's format (the fp32 values stored by the same quantizer), whose path
shares no code with the loaders' conversion. A version-3 state into version 3 is exact. A map
id of an unknown version is refused naming the field. The multi-rank side (version 3 resharded
at world sizes 4 -> 2 -> 3, and converted at 2) is in test_compressed_checkpoint.py, whose
helpers these tests share.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_compressed_checkpoint import (
    MAPS,
    MORE,
    SAVE_AT,
    _edited,
    _one,
    assert_converted,
    assert_same,
    assert_stored_same,
    build,
    maps_of,
    snapshot,
    train,
)
from torch import nn

import zerokern
from zerokern.checkpoint import load_checkpoint, save_checkpoint
from zerokern.checkpoint.format import META

pytest.importorskip("safetensors.torch")  # the [checkpoint] extra


VERSION_PAIRS = [(2, 3), (3, 2)]


def _converted_resume(model: nn.Module, opt: zerokern.ZeroAdamW, m2: nn.Module,
                      o2: zerokern.ZeroAdamW, loaded: int) -> None:
    m3, o3 = build(2, "int8", "none", init=2, int8_format=loaded)
    m3.load_state_dict(model.state_dict())
    o3.load_state_dict(opt.full_state_dict())
    train(m2, o2, SAVE_AT, MORE)
    train(m3, o3, SAVE_AT, MORE)
    assert_same(snapshot(m2, o2), snapshot(m3, o3))
    assert o2.state_dict()["zerokern"]["state_format"]["maps"] == maps_of(loaded)


@pytest.mark.parametrize("saved,loaded", VERSION_PAIRS)
def test_checkpoint_converts_between_int8_versions(tmp_path, saved, loaded):
    model, opt = _one("int8", "none", int8_format=saved)
    save_checkpoint(tmp_path / "ck", model, opt)
    assert json.loads((tmp_path / "ck" / META).read_text())["state_format"]["maps"] == \
        maps_of(saved)
    m2, o2 = build(1, "int8", "none", init=1, int8_format=loaded)
    load_checkpoint(tmp_path / "ck", m2, o2)
    assert_converted(snapshot(m2, o2), snapshot(model, opt), loaded)
    _converted_resume(model, opt, m2, o2, loaded)


def test_version_1_checkpoint_converts_into_version_3(tmp_path):
    """A version 1 checkpoint (the version 2 maps' values under the version 1 ids, absmax
    >= 0) converts into version 3 as version 2 does: decoded on its maps."""
    model, opt = _one("int8", "fp32", int8_format=2)
    save_checkpoint(tmp_path / "ck", model, opt)
    _edited(tmp_path / "ck", lambda m: m["state_format"]["maps"].update(
        exp_avg="dynamic-signed-v1", exp_avg_sq="dynamic-unsigned-v1"))
    m2, o2 = build(2, "int8", "fp32", init=1, int8_format=3)
    load_checkpoint(tmp_path / "ck", m2, o2)
    assert_converted(snapshot(m2, o2), snapshot(model, opt), 3)


@pytest.mark.parametrize("saved,loaded", VERSION_PAIRS)
def test_per_rank_state_dict_converts_between_int8_versions(saved, loaded):
    model, opt = _one("int8", "none", stage=1, int8_format=saved)
    sd = opt.state_dict()
    assert sd["zerokern"]["state_format"]["maps"] == maps_of(saved)
    m2, o2 = build(1, "int8", "none", init=1, int8_format=loaded)
    m2.load_state_dict(model.state_dict())
    # A version this zerokern does not know: refused naming the field, nothing loaded.
    bad = {**sd, "zerokern": {**sd["zerokern"], "state_format": {
        **sd["zerokern"]["state_format"], "maps": {**maps_of(saved),
                                                   "exp_avg": "computed-signed-v4"}}}}
    with pytest.raises(ValueError, match=r"state_format\.maps\['exp_avg'\] is "
                                         r"'computed-signed-v4', a code map"):
        o2.load_state_dict(bad)
    assert o2.layout is None
    o2.load_state_dict(sd)
    assert_converted(snapshot(m2, o2), snapshot(model, opt), loaded)
    _converted_resume(model, opt, m2, o2, loaded)


def test_int8_format_3_state_round_trips_exactly():
    """Version 3 into version 3: a per-rank state dict copies the codes; the fp32 values of
    torch's format, stored back by version 3's quantizer, give the same codes and scales
    (decoded normal values re-encode exactly); both then train on alike."""
    model, opt = _one("int8", "none", stage=1, int8_format=3)
    sd = opt.state_dict()
    m2, o2 = build(1, "int8", "none", init=1, int8_format=3)
    m2.load_state_dict(model.state_dict())
    o2.load_state_dict(sd)
    assert_stored_same(o2.state_dict(), sd)
    o2.load_state_dict(o2.full_state_dict())
    assert_stored_same(o2.state_dict(), sd)
    train(model, opt, SAVE_AT, MORE)
    train(m2, o2, SAVE_AT, MORE)
    assert_same(snapshot(m2, o2), snapshot(model, opt))


def test_consolidate_reads_int8_format_3(tmp_path):
    """The consolidate command decodes version 3's codes on its maps: the fp32 moments are
    full_state_dict's."""
    from zerokern.cli import consolidate as cli

    model, opt = _one("int8", "fp32", int8_format=3)
    save_checkpoint(tmp_path / "ck", model, opt)
    cli.consolidate(str(tmp_path / "ck"), str(tmp_path / "model.safetensors"),
                    str(tmp_path / "adamw.pt"))
    adamw = torch.load(tmp_path / "adamw.pt", weights_only=True)
    for i, s in opt.full_state_dict()["state"].items():
        for key in MAPS:
            assert torch.equal(adamw["state"][i][key], s[key]), (i, key)
