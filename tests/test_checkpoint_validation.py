"""load_checkpoint checks all of meta.json and every rank-file header before it changes anything
(issue 14): each case edits a copy of a real checkpoint (world 1, stage 2, two param groups, a
frozen parameter, a buffer, a loss scaler), expects a CheckpointError naming the file and the
field, and checks that the model, the optimizer state and every file on disk are unchanged.
Edits recompute meta_sha256 so that they reach the check they are about, except those that
test the digest itself."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import TinyGPT, batch

import zerokern
from zerokern.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from zerokern.checkpoint.format import META, META_DIGEST, meta_digest
from zerokern.checkpoint.load import open_checkpoint

pytest.importorskip("safetensors")

FIXTURE_V1 = Path(__file__).parent / "fixtures" / "pre_engine" / "ck_stage2_world2"
RANK0 = "rank00000.safetensors"


def build(seed: int) -> tuple[torch.nn.Module, zerokern.ZeroAdamW]:
    torch.manual_seed(seed)
    model = TinyGPT()
    model.ln_f.bias.requires_grad_(False)  # a frozen parameter, stored as frozen.float32
    model.register_buffer("seen", torch.arange(2, dtype=torch.int64) + seed)
    decay = {n for n, p in model.named_parameters() if p.dim() >= 2}
    groups = [
        dict(params=[p for n, p in model.named_parameters() if n in decay]),
        dict(params=[p for n, p in model.named_parameters() if n not in decay],
             weight_decay=0.0),
    ]
    # bucket_numel: parameters straddle buckets, so most have several piece rows
    opt = zerokern.ZeroAdamW(groups, lr=1e-2, stage=2, bucket_numel=96, loss_scale=1024.0)
    return model, opt


def train(model: torch.nn.Module, opt: zerokern.ZeroAdamW, steps: range) -> None:
    for k in steps:
        x, y = batch(k, 0, n=4)
        opt.scale_loss(F.cross_entropy(model(x), y)).backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    model, opt = build(0)
    train(model, opt, range(2))
    save_checkpoint(root / "ck", model, opt, extra={"step": 2})
    return root / "ck"


@pytest.fixture
def ck(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "ck")
    (tmp_path / "outside").mkdir()
    return tmp_path / "ck"


def read(ck: Path) -> dict[str, Any]:
    return json.loads((ck / META).read_text())


def write(ck: Path, meta: dict[str, Any], digest: bool = True) -> None:
    if digest:
        meta[META_DIGEST] = meta_digest(meta)
    (ck / META).write_text(json.dumps(meta))


def disk(root: Path) -> dict[str, str]:
    """Every path under root (but the PATH.lock files a load creates): a link's target, a
    file's sha256."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.name.endswith(".lock"):
            continue
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def refused(ck: Path, match: str, *, verify: bool = True) -> str:
    """Load ck into a trained model and optimizer: must raise CheckpointError matching
    ``match`` up front, changing neither them nor any file."""
    model, opt = build(5)
    train(model, opt, range(1))  # laid out, with state: a partial load would show
    root = ck.parent
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), disk(root))
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(ck, model, opt, verify=verify)
    assert "part-way" not in str(info.value)
    after = (model.state_dict(), opt.state_dict(), disk(root))
    for what, a, b in zip(("model", "optimizer", "files"), before, after):
        assert same(a, b), f"the refused load changed the {what}"
    return str(info.value)


def rows(meta: dict[str, Any]) -> list[list[Any]]:
    return meta["files"][0]["pieces"]


def row(meta: dict[str, Any], name: str, k: int = 0) -> list[Any]:
    """The k-th piece row of parameter ``name`` (a list: edit it in place)."""
    return [r for r in rows(meta) if r[0] == name][k]


Edit = Callable[[dict[str, Any], Path], None]


def _parent_of(meta: dict[str, Any], path: str) -> tuple[Any, Any]:
    """For "k1/k2/.../last" (list indices as digits): meta[k1][k2]... and last."""
    *keys, last = [int(k) if k.isdigit() else k for k in path.split("/")]
    obj = meta
    for k in keys:
        obj = obj[k]
    return obj, last


def setter(path: str, value: Any) -> Edit:
    def edit(meta: dict[str, Any], ck: Path) -> None:
        obj, last = _parent_of(meta, path)
        obj[last] = value

    return edit


def deleter(path: str) -> Edit:
    def edit(meta: dict[str, Any], ck: Path) -> None:
        obj, last = _parent_of(meta, path)
        del obj[last]

    return edit


def cases(table: dict[str, tuple[Edit, str]]) -> Any:
    """A table of named (edit, expected message) cases as pytest parameters."""
    return pytest.mark.parametrize("edit, match", list(table.values()), ids=list(table))


def run_case(ck: Path, edit: Edit, match: str) -> str:
    meta = read(ck)
    edit(meta, ck)
    if not (ck / META).is_symlink():
        write(ck, meta)
    return refused(ck, match)


# -- 3: file names outside the directory, symbolic links ------------------------------------
def _copy_out(ck: Path) -> Path:
    dst = ck.parent / "outside" / RANK0
    shutil.copy(ck / RANK0, dst)
    return dst


def _name(value: Callable[[Path], str]) -> Edit:
    def edit(meta: dict[str, Any], ck: Path) -> None:
        meta["files"][0]["name"] = value(ck)

    return edit


def _moved_to_subdir(ck: Path) -> str:
    (ck / "sub").mkdir()
    shutil.copy(ck / RANK0, ck / "sub" / RANK0)
    return f"sub/{RANK0}"


def _renamed(ck: Path) -> str:
    shutil.copy(ck / RANK0, ck / "rank0.safetensors")
    return "rank0.safetensors"


def _link_rank_file(meta: dict[str, Any], ck: Path) -> None:
    target = _copy_out(ck)
    (ck / RANK0).unlink()
    (ck / RANK0).symlink_to(target)


def _link_meta(meta: dict[str, Any], ck: Path) -> None:
    target = ck.parent / "outside" / META
    write(target.parent, meta)
    (ck / META).unlink()
    (ck / META).symlink_to(target)


def _parent(ck: Path) -> str:
    _copy_out(ck)
    return f"../outside/{RANK0}"


NAME = r"files\[0\]\.name must be a plain file name rankNNNNN\.safetensors"
PATH_CASES = {
    "parent": (_name(_parent), NAME),
    "absolute": (_name(lambda ck: str(_copy_out(ck))), NAME),
    "subdirectory": (_name(_moved_to_subdir), NAME),
    "dot-slash": (_name(lambda ck: f"./{RANK0}"), NAME),
    "dot-dot": (_name(lambda ck: ".."), NAME),
    "not-the-pattern": (_name(_renamed), NAME),
    "not-a-string": (_name(lambda ck: ["rank00000.safetensors"]), NAME),
    "another-ranks-name": (_name(lambda ck: "rank00001.safetensors"),
                           r"files\[0\]\.name must be 'rank00000\.safetensors' \(rank 0\)"),
    "rank-file-symlink": (_link_rank_file, f"{RANK0} is a symbolic link"),
    "meta-symlink": (_link_meta, f"{META} is a symbolic link"),
}


@cases(PATH_CASES)
def test_file_names_must_be_plain_files_inside_the_directory(ck, edit, match):
    run_case(ck, edit, match)


# -- 4: piece rows --------------------------------------------------------------------------
def _in_row(name: str, k: int, col: int, value: Any) -> Edit:
    def edit(meta: dict[str, Any], ck: Path) -> None:
        row(meta, name, k)[col] = value

    return edit


def _replace_row(name: str, make: Callable[[list[Any]], Any]) -> Edit:
    def edit(meta: dict[str, Any], ck: Path) -> None:
        r = rows(meta)
        j = r.index(row(meta, name))
        r[j] = make(r[j])

    return edit


def _last_state_row_shifted(meta: dict[str, Any], ck: Path) -> None:
    max((r for r in rows(meta) if r[3] == "state"), key=lambda r: r[4])[4] += 1


def _duplicated(meta: dict[str, Any], ck: Path) -> None:
    rows(meta).append(list(row(meta, "pos")))


def _dropped(meta: dict[str, Any], ck: Path) -> None:
    rows(meta).remove(row(meta, "emb.weight", 2))


def _stored_twice(meta: dict[str, Any], ck: Path) -> None:
    row(meta, "blocks.0.ln.bias")[4] = row(meta, "blocks.0.ln.weight")[4]  # both 13 long


ROW = r"files\[0\]\.pieces\[\d+\]"
ROW_CASES = {
    # The reported bug: a negative offset read another parameter's elements, silently.
    "negative-param-offset": (_in_row("emb.weight", 1, 1, -1),
                              ROW + r": the param offset must be an integer >= 0, got -1"),
    "fractional-param-offset": (_in_row("emb.weight", 1, 1, 10.5), ROW + r".*got 10\.5"),
    "bool-param-offset": (_in_row("pos", 0, 1, False), ROW + r".*param offset.*got False"),
    "negative-numel": (_in_row("pos", 0, 2, -65), ROW + r": the numel must be.*got -65"),
    "float-numel": (_in_row("pos", 0, 2, 65.0), ROW + r": the numel must be.*got 65\.0"),
    "negative-tensor-offset": (_in_row("emb.weight", 0, 4, -65),
                               ROW + r": the offset in tensor must be.*got -65"),
    "very-negative-tensor-offset": (_in_row("emb.weight", 0, 4, -(10**12)),
                                    ROW + r": the offset in tensor must be"),
    "string-tensor-offset": (_in_row("pos", 0, 4, "0"), ROW + r": the offset in tensor"),
    "short-row": (_replace_row("pos", lambda r: r[:4]), ROW + r" must be a row \[param name"),
    "not-a-row": (_replace_row("pos", lambda r: {"name": "pos"}), ROW + r" must be a row"),
    "name-not-a-string": (_in_row("pos", 0, 0, 7), ROW + r": the param name must be a string"),
    "unknown-parameter": (_in_row("pos", 0, 0, "nope"),
                          ROW + r" holds pieces of 'nope', which is not a parameter"),
    "unknown-tensor": (_in_row("pos", 0, 3, "exp_avg"),
                       ROW + r": the tensor must be 'state' or 'frozen.<dtype>'"),
    "buffer-as-tensor": (_in_row("pos", 0, 3, "buffer/seen"), ROW + r": the tensor must be"),
    "beyond-the-parameter": (_in_row("pos", 0, 2, 66),
                             ROW + r" holds elements \[0, 66\) of 'pos', which has 65"),
    "beyond-the-stored-tensor": (_last_state_row_shifted,
                                 rf"{RANK0} does not match {META}.*{ROW} reads elements "
                                 r"\[\d+, \d+\) of tensor 'state', which has \d+"),
    "stored-twice": (_stored_twice, rf"{RANK0} does not match {META}.*the pieces in tensor "
                                    r"'state' leave a gap or overlap"),
    "overlap-in-parameter": (_duplicated, r"the pieces of 'pos' leave a gap or overlap"),
    "gap-in-parameter": (_dropped, r"the pieces of 'emb.weight' leave a gap or overlap"),
    "frozen-read-from-state": (_in_row("ln_f.bias", 0, 3, "state"),
                               r"params\['ln_f.bias'\] is not trained \(managed\) but its "
                               r"pieces are in tensor 'state'"),
    "trained-read-from-frozen": (_in_row("pos", 0, 3, "frozen.float32"),
                                 r"params\['pos'\] is trained \(managed\) but its pieces are "
                                 r"in tensor 'frozen.float32'"),
    "mixed-kinds": (_in_row("emb.weight", 1, 3, "frozen.float32"),
                    r"'emb.weight' is stored in more than one tensor kind"),
}


@cases(ROW_CASES)
def test_piece_rows_are_checked_before_loading(ck, edit, match):
    run_case(ck, edit, match)


def _buffer_forgotten(meta: dict[str, Any], ck: Path) -> None:
    meta["files"][0]["buffers"] = []
    del meta["buffers"]["seen"]
    meta["state_dict_keys"].remove("seen")


HEADER_CASES = {
    "save-id-of-another-save": (setter("save_id", "0123456789abcdef"),
                                rf"{RANK0} does not match {META}.*its header has save_id"),
    "buffer-shape": (setter("buffers/seen/shape", [1, 2]),
                     r"tensor 'buffer/seen' is torch.int64 of shape \[2\], expected "
                     r"torch.int64 of shape \[1, 2\]"),
    "buffer-dtype": (setter("buffers/seen/dtype", "float32"), r"tensor 'buffer/seen' is"),
    "buffer-not-in-file": (setter("files/0/buffers", []),
                           r"buffers has 'seen', which no files\[i\]\.buffers lists"),
    "tensor-not-named": (_buffer_forgotten,
                         r"it holds tensor 'buffer/seen', which files\[0\] does not name"),
}


@cases(HEADER_CASES)
def test_rank_file_headers_must_match_meta(ck, edit, match):
    run_case(ck, edit, match)


# -- 5: problems that surfaced part-way through a load ----------------------------------------
def _group_dropped(meta: dict[str, Any], ck: Path) -> None:
    del meta["param_groups"][1]


def _unlisted(meta: dict[str, Any], ck: Path) -> None:
    meta["param_groups"][0]["params"].remove("pos")


def _listed_twice(meta: dict[str, Any], ck: Path) -> None:
    meta["param_groups"][1]["params"].append("pos")


GROUP = r"params\['[^']+'\]\.group must be a param group index below"
LATE_CASES = {
    "group-deleted": (_group_dropped, GROUP + r" 1, got 1"),
    "hyper-deleted": (deleter("param_groups/0/hyper"), r"param_groups\[0\] lacks the entry "
                                                       r"'hyper'"),
    "lr-deleted": (deleter("param_groups/1/hyper/lr"),
                   r"param_groups\[1\]\.hyper lacks the entry 'lr'"),
    "param-groups-deleted": (deleter("param_groups"), r"the top level lacks the entry "
                                                      r"'param_groups'"),
    "step-deleted": (deleter("params/pos/step"), r"params\['pos'\] lacks the entry 'step'"),
    "step-float": (setter("params/pos/step", 2.0),
                   r"params\['pos'\]\.step must be an integer >= 0.*got 2\.0"),
    "step-string": (setter("params/pos/step", "2"), r"params\['pos'\]\.step must be"),
    "step-null": (setter("params/pos/step", None), r"params\['pos'\]\.step must be"),
    "frozen-with-step": (setter("params/ln_f.bias/step", 3),
                         r"params\['ln_f.bias'\]\.step must be null"),
    "group-out-of-range": (setter("params/pos/group", 9), GROUP + r" 2, got 9"),
    "group-negative": (setter("params/pos/group", -1), GROUP + r" 2, got -1"),
    "group-null": (setter("params/pos/group", None), GROUP + r" 2, got None"),
    "group-bool": (setter("params/pos/group", True), GROUP + r" 2, got True"),
    "group-disagrees": (setter("params/pos/group", 1),
                        r"param_groups\[0\]\.params\[0\] is 'pos', whose params\['pos'\]"
                        r"\.group is 1"),
    "unlisted": (_unlisted, r"params\['pos'\]\.group is 0 but param_groups\[0\] does not "
                            r"list it"),
    "listed-twice": (_listed_twice, r"param_groups\[1\]\.params\[\d+\] is 'pos', which "
                                    r"param_groups\[0\] lists too"),
    "unknown-in-group": (setter("param_groups/1/params/0", "nope"),
                         r"param_groups\[1\]\.params\[0\] must be a parameter, got 'nope'"),
    "ready-order-unknown": (setter("ready_order/0", "ln_f.bias"),
                            r"ready_order\[0\] must be a trained parameter, got 'ln_f.bias'"),
    "ready-order-not-a-list": (setter("ready_order", "pos"), r"ready_order must be a list"),
    "buffer-deleted": (deleter("buffers/seen"),
                       r"state_dict_keys\[\d+\] must be a parameter, buffer or alias"),
    "alias-to-nothing": (setter("aliases/head.weight", "nope"),
                         r"aliases\['head.weight'\] must be a parameter or buffer"),
    "shape-not-a-list": (setter("params/pos/shape", "5x13"),
                         r"params\['pos'\]\.shape must be a list of integers"),
    "dtype-unknown": (setter("params/pos/dtype", "float99"),
                      r"params\['pos'\]\.dtype must be a dtype name"),
    "managed-not-bool": (setter("params/pos/managed", 1),
                         r"params\['pos'\]\.managed must be true or false"),
    "world-size": (setter("world_size", 2), r"files must be a list of 2 entries"),
    "stage": (setter("stage", 7), r"stage must be 0, 1, 2 or 3, got 7"),
    "param-dtype": (setter("param_dtype", ["float32"]), r"param_dtype must be one of"),
    "file-bytes": (setter("files/0/bytes", -1), r"files\[0\]\.bytes must be an integer"),
    "file-sha256": (setter("files/0/sha256", "abc"), r"files\[0\]\.sha256 must be 64"),
    "file-rank": (setter("files/0/rank", 1), r"files\[0\]\.rank must be 0, got 1"),
    "created-ns": (setter("created_ns", "now"), r"created_ns must be an integer"),
    # Model-dependent, still before anything changes: the same number of elements.
    "transposed-shape": (setter("params/blocks.0.up.weight/shape", [13, 27]),
                         r"parameter 'blocks.0.up.weight' has shape \[13, 27\] in the "
                         r"checkpoint, \[27, 13\] in the model"),
}


@cases(LATE_CASES)
def test_meta_problems_are_found_before_loading(ck, edit, match):
    run_case(ck, edit, match)


# -- 6: hyperparameters, unknown keys, the loss scaler ----------------------------------------
HYPER = r"param_groups\[1\]\.hyper\."
SCALER_KEYS = sorted(zerokern.ZeroAdamW([torch.nn.Parameter(torch.zeros(1))],
                                        loss_scale=2.0).scaler.state_dict())
HPARAM_CASES = {
    "lr-negative": (setter("param_groups/1/hyper/lr", -1),
                    HYPER + r"lr must be a finite number >= 0, got -1"),
    "lr-string": (setter("param_groups/1/hyper/lr", "abc"), HYPER + r"lr must be.*got 'abc'"),
    "lr-bool": (setter("param_groups/1/hyper/lr", True), HYPER + r"lr must be.*got True"),
    "lr-null": (setter("param_groups/1/hyper/lr", None), HYPER + r"lr must be.*got None"),
    "lr-nan": (setter("param_groups/1/hyper/lr", float("nan")), HYPER + r"lr must be.*nan"),
    "eps-string": (setter("param_groups/1/hyper/eps", "1e-8"), HYPER + r"eps must be a finite"),
    "weight-decay-negative": (setter("param_groups/0/hyper/weight_decay", -0.1),
                              r"param_groups\[0\]\.hyper\.weight_decay must be a finite"),
    "weight-decay-inf": (setter("param_groups/0/hyper/weight_decay", float("inf")),
                         r"param_groups\[0\]\.hyper\.weight_decay must be a finite"),
    "betas-out-of-range": (setter("param_groups/1/hyper/betas", [2, 3]),
                           HYPER + r"betas\[0\] must be in \[0, 1\), got 2"),
    "beta2-one": (setter("param_groups/1/hyper/betas", [0.9, 1.0]),
                  HYPER + r"betas\[1\] must be in \[0, 1\), got 1\.0"),
    "betas-single": (setter("param_groups/1/hyper/betas", [0.9]),
                     HYPER + r"betas must be a pair of numbers"),
    "betas-string": (setter("param_groups/1/hyper/betas", [0.9, "x"]),
                     HYPER + r"betas must be a pair"),
    "initial-lr": (setter("param_groups/1/hyper/initial_lr", "x"),
                   HYPER + r"initial_lr must be a finite number"),
    "param-names-length": (setter("param_groups/1/hyper/param_names", ["a"]),
                           HYPER + r"param_names must be \d+ names"),
    "step-negative": (setter("params/pos/step", -5), r"params\['pos'\]\.step must be an "
                                                     r"integer >= 0.*got -5"),
    "unknown-hyper-key": (setter("param_groups/1/hyper/foo", 1),
                          HYPER[:-2] + r" has an unknown entry 'foo'"),
    "unknown-group-key": (setter("param_groups/0/name", "decay"),
                          r"param_groups\[0\] has an unknown entry 'name'"),
    "unknown-top-key": (setter("notes", "hi"), r"the top level has an unknown entry 'notes'"),
    "unknown-param-key": (setter("params/pos/lr", 1.0),
                          r"params\['pos'\] has an unknown entry 'lr'"),
    "unknown-buffer-key": (setter("buffers/seen/x", 1),
                           r"buffers\['seen'\] has an unknown entry 'x'"),
    "unknown-file-key": (setter("files/0/x", 1), r"files\[0\] has an unknown entry 'x'"),
    "scaler-garbage": (setter("scaler", "garbage"), r"scaler must be a JSON object"),
    "scaler-list": (setter("scaler", [1024.0]), r"scaler must be a JSON object"),
    "scaler-missing-key": (deleter("scaler/good_steps"), r"scaler lacks the entry 'good_steps'"),
    "scaler-unknown-key": (setter("scaler/extra", 1), r"scaler has an unknown entry 'extra'"),
    "scaler-scale-negative": (setter("scaler/scale", -1.0),
                              r"scaler\.scale must be a finite number > 0, got -1\.0"),
    "scaler-scale-zero": (setter("scaler/scale", 0), r"scaler\.scale must be a finite number"),
    "scaler-scale-string": (setter("scaler/scale", "big"), r"scaler\.scale must be"),
    "scaler-dynamic": (setter("scaler/dynamic", "yes"), r"scaler\.dynamic must be true or "
                                                        r"false"),
    "scaler-good-steps": (setter("scaler/good_steps", 1.5),
                          r"scaler\.good_steps must be an integer >= 0"),
    "scaler-growth-interval": (setter("scaler/growth_interval", 0),
                               r"scaler\.growth_interval must be an integer > 0"),
}


@cases(HPARAM_CASES)
def test_hyperparameters_keys_and_scaler_are_checked(ck, edit, match):
    msg = run_case(ck, edit, match)
    assert f"{META} in {ck}" in msg


def test_scaler_keys_are_the_loss_scalers(saved):
    assert sorted(read(saved)["scaler"]) == SCALER_KEYS


# -- 7: meta_sha256 ---------------------------------------------------------------------------
def _swap_same_size_pieces(meta: dict[str, Any]) -> None:
    a, b = row(meta, "blocks.0.ln.weight"), row(meta, "blocks.0.ln.bias")
    assert a[2] == b[2]  # both 13 elements: every other check still passes
    a[4], b[4] = b[4], a[4]


def test_digest_detects_swapped_pieces(ck):
    meta = read(ck)
    _swap_same_size_pieces(meta)
    write(ck, meta, digest=False)
    refused(ck, r"meta_sha256 does not match the content")
    refused(ck, r"meta_sha256 does not match", verify=False)  # checked even so: cheap
    write(ck, meta)  # with the digest recomputed the swap is a well-formed checkpoint ...
    assert open_checkpoint(str(ck)).meta["files"][0]["pieces"] == rows(meta)  # ... only it


DIGEST_CASES = {
    "value-edited": (setter("param_groups/0/hyper/lr", 0.5), r"meta_sha256 does not match"),
    "extra-edited": (setter("extra", {"step": 3}), r"meta_sha256 does not match"),
    "digest-deleted": (deleter(META_DIGEST), r"meta_sha256 is missing \(required from format "
                                             r"version 2 on"),
    "digest-not-a-string": (setter(META_DIGEST, 5), r"meta_sha256 does not match"),
    "version-edited-down": (setter("format_version", 1), r"meta_sha256 does not match"),
    "version-newer": (setter("format_version", 3), r"format version 3 was written by a newer"),
    "version-string": (setter("format_version", "2"), r"format_version must be an integer"),
    "version-bool": (setter("format_version", True), r"format_version must be an integer"),
    "version-zero": (setter("format_version", 0), r"format_version must be an integer >= 1"),
}


@cases(DIGEST_CASES)
def test_digest_is_required_and_checked(ck, edit, match):
    meta = read(ck)
    edit(meta, ck)
    write(ck, meta, digest=False)
    refused(ck, match)


# -- what must keep loading ------------------------------------------------------------------
@pytest.fixture
def v1(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURE_V1, tmp_path / "ck")
    return tmp_path / "ck"


def test_version1_checkpoint_without_digest_loads(v1):
    from make_fixtures import build as build_v1

    meta = read(v1)
    assert meta["format_version"] == 1 and META_DIGEST not in meta
    for verify in (True, False):
        model, opt = build_v1(2)
        assert load_checkpoint(v1, model, opt, verify=verify) == {"step": 3}
        assert all(sh.step == meta["params"][sh.name]["step"] for sh in opt.shards(model))


def test_version1_checkpoint_is_still_checked(v1):
    from make_fixtures import build as build_v1

    meta = read(v1)
    meta["param_groups"][0]["hyper"]["lr"] = -1
    write(v1, meta, digest=False)
    model, opt = build_v1(2)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match=r"param_groups\[0\]\.hyper\.lr must be"):
        load_checkpoint(v1, model, opt)
    assert same(model.state_dict(), before) and opt.layout is None


def test_what_torch_adds_to_groups_round_trips(tmp_path):
    """param_names (an optimizer built from named_parameters()) and an LR scheduler's
    initial_lr are written by save_checkpoint: they must load."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = zerokern.ZeroAdamW(model.named_parameters(), lr=1e-2, stage=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e)
    train(model, opt, range(2))
    sched.step()
    save_checkpoint(tmp_path / "ck", model, opt, extra=sched.state_dict())
    hyper = read(tmp_path / "ck")["param_groups"][0]["hyper"]
    assert {"param_names", "initial_lr"} <= hyper.keys()
    torch.manual_seed(1)
    model2 = TinyGPT()
    opt2 = zerokern.ZeroAdamW(model2.named_parameters(), lr=0.5, stage=2)
    load_checkpoint(tmp_path / "ck", model2, opt2)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 5e-3
    assert opt2.param_groups[0]["initial_lr"] == 1e-2


class _WithEmpty(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.empty = torch.nn.Parameter(torch.zeros(0))  # trained, no elements
        self.frozen_empty = torch.nn.Parameter(torch.zeros(0, 2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("stage", [2, 3])
def test_parameters_without_elements_save_and_load(tmp_path, stage):
    """No pieces for an empty trained parameter, a 0-element row for an empty frozen one."""
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = _WithEmpty()
        m = zerokern.shard_model(m) if stage == 3 else m
        opt = zerokern.ZeroAdamW(m.parameters(), lr=0.1, stage=stage)
        m(torch.randn(4, 3)).sum().backward()
        opt.step()
        models.append((m, opt))
    save_checkpoint(tmp_path / "ck", *models[0])
    load_checkpoint(tmp_path / "ck", *models[1])
    a, b = (zerokern.full_state_dict(m, rank0_only=False) for m, _ in models)
    assert same(a, b)


def test_save_refuses_a_group_key_no_load_would_accept(tmp_path):
    m = torch.nn.Linear(3, 2)
    opt = zerokern.ZeroAdamW([{"params": m.parameters(), "name": "decay"}], stage=1)
    with pytest.raises(CheckpointError, match="param group 0 has the key 'name'.*extra="):
        zerokern.save_checkpoint(str(tmp_path / "ck"), m, opt)
    assert os.listdir(tmp_path) in ([], ["ck.lock"])
