"""``python -m zerokern consolidate`` refuses what would damage the checkpoint or fail part-way
(issue 14, items 2, 8, 9): outputs inside the checkpoint directory (also through symlinks,
``..`` and relative paths), --optimizer equal to OUT, sizes that do not fit in memory or on
disk; a write that fails (ENOSPC, an interrupt) leaves no ``.partial`` file; the outputs load
with ``torch.load(weights_only=True)``. Every refusal must leave the checkpoint byte-identical,
print one line (no traceback) and exit non-zero.

Checkpoints are saved once per module at world size 1 and copied per test; consolidate runs
in-process through main(argv), and once as ``python -m zerokern consolidate`` for the exit
status of the real command line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import zerokern
from zerokern.checkpoint import format, save_checkpoint
from zerokern.cli import consolidate as cli

st = pytest.importorskip("safetensors.torch")  # the [checkpoint] extra

HUGE = 2**34  # elements: 64 GiB of fp32, the size of the report


def _save(path, model):
    opt = zerokern.ZeroAdamW(model.parameters(), lr=1e-2, stage=1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # so the optimizer file has exp_avg / exp_avg_sq to write
    opt.zero_grad()
    save_checkpoint(str(path), model, opt)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model.register_buffer("seen", torch.arange(2, dtype=torch.int64))
    ck = tmp_path_factory.mktemp("saved") / "ck"
    _save(ck, model)
    return ck, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def ck(saved, tmp_path):
    """A fresh copy of the saved checkpoint, as tmp_path/ck."""
    dst = tmp_path / "ck"
    shutil.copytree(saved[0], dst)
    return dst


def digests(d):
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def no_partial(root):
    return [str(p) for p in root.rglob("*.partial")] == []


def refused(capsys, ck, root, argv, *, status=1):
    """Run main(argv) on the checkpoint ``ck``; assert the exit status, that the checkpoint is
    unchanged and no .partial is left; return the one-line error."""
    before = digests(ck)
    assert cli.main(argv) == status
    assert digests(ck) == before
    assert no_partial(root)
    err = capsys.readouterr().err
    assert err.startswith("consolidate: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def edit_meta(ck, edit):
    """Change meta.json and recompute its digest: the edit is what gets checked, not the
    digest."""
    path = ck / "meta.json"
    meta = json.loads(path.read_text())
    edit(meta)
    meta[format.META_DIGEST] = format.meta_digest(meta)
    path.write_text(json.dumps(meta))


def claim_huge_weight(ck):
    """meta.json claims HUGE elements for 0.weight, which the rank file does not hold."""

    def edit(meta):
        meta["params"]["0.weight"]["shape"] = [HUGE]

    edit_meta(ck, edit)


# -- outputs that would overwrite the checkpoint ------------------------------------------------
@pytest.mark.parametrize(
    "target",
    [
        "rank00000.safetensors",  # the report: the checkpoint no longer loaded
        "meta.json",
        "../ck/./meta.json",  # `..` and `.` inside, relative to the checkpoint
        "",  # the checkpoint directory itself
        "new/model.safetensors",  # any path under it, even one that does not exist yet
    ],
)
def test_out_inside_the_checkpoint_is_refused(ck, tmp_path, capsys, target):
    err = refused(capsys, ck, tmp_path, [str(ck), os.path.join(str(ck), target)])
    assert "error: OUT " in err and "inside the checkpoint directory" in err


def test_out_relative_path_into_the_checkpoint_is_refused(ck, tmp_path, capsys, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    err = refused(capsys, ck, tmp_path, ["../ck", "../ck/meta.json"])
    assert "error: OUT ../ck/meta.json resolves to" in err and str(ck / "meta.json") in err


def test_out_through_a_symlink_into_the_checkpoint_is_refused(ck, tmp_path, capsys):
    (tmp_path / "link").symlink_to(ck, target_is_directory=True)
    err = refused(capsys, ck, tmp_path, [str(ck), str(tmp_path / "link" / "rank00000.safetensors")])
    assert "error: OUT " in err and "inside the checkpoint directory" in err
    # A file symlink whose target is in the checkpoint, and the checkpoint read through a link.
    (tmp_path / "model.safetensors").symlink_to(ck / "meta.json")
    err = refused(
        capsys, ck, tmp_path, [str(tmp_path / "link"), str(tmp_path / "model.safetensors")]
    )
    assert "error: OUT " in err and str(ck / "meta.json") in err


def test_partial_file_symlinked_into_the_checkpoint_is_refused(ck, tmp_path, capsys):
    # OUT itself is outside, but its .partial (written first) would write through the link.
    (tmp_path / "m.safetensors.partial").symlink_to(ck / "rank00000.safetensors")
    before = digests(ck)
    assert cli.main([str(ck), str(tmp_path / "m.safetensors")]) == 1
    assert digests(ck) == before
    err = capsys.readouterr().err
    assert "error: OUT " in err and "temporary file" in err and "Traceback" not in err
    assert (tmp_path / "m.safetensors.partial").is_symlink()  # not ours: left alone


def test_optimizer_inside_the_checkpoint_is_refused(ck, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    err = refused(capsys, ck, tmp_path, [str(ck), str(out), "--optimizer", str(ck / "meta.json")])
    assert "error: --optimizer " in err and "inside the checkpoint directory" in err
    assert not out.exists()  # refused before the model was written


def test_checkpoint_lock_file_as_out_is_refused(ck, tmp_path, capsys):
    err = refused(capsys, ck, tmp_path, [str(ck), str(tmp_path / "ck.lock")])
    assert "error: OUT " in err and "lock file" in err


def test_optimizer_equal_to_out_is_refused(ck, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [str(ck), "model.safetensors", "--optimizer", "./sub/../model.safetensors"]
    (tmp_path / "sub").mkdir()
    err = refused(capsys, ck, tmp_path, argv)
    assert "error: --optimizer ./sub/../model.safetensors is the same file as OUT" in err
    assert not (tmp_path / "model.safetensors").exists()


# -- sizes ----------------------------------------------------------------------------------------
def test_claimed_huge_parameter_is_refused(ck, tmp_path, capsys):
    claim_huge_weight(ck)
    out = tmp_path / "model.safetensors"
    argv = [str(ck), str(out), "--optimizer", str(tmp_path / "adamw.pt")]
    err = refused(capsys, ck, tmp_path, argv)
    # open_checkpoint refuses it first: the pieces in the file do not back the claim.
    assert "'0.weight'" in err and str(HUGE) in err and "MemoryError" not in err
    assert not out.exists()


def test_claimed_huge_buffer_is_refused(ck, tmp_path, capsys):
    # A buffer's shape is meta.json's word alone: consolidate checks it against the file.
    def edit(meta):
        meta["buffers"]["seen"]["shape"] = [HUGE]

    edit_meta(ck, edit)
    err = refused(capsys, ck, tmp_path, [str(ck), str(tmp_path / "model.safetensors")])
    # open_checkpoint may refuse it first (its checks grow): either way, named with both sizes.
    assert "'seen'" in err or "'buffer/seen'" in err
    assert str(HUGE) in err and "shape [2]" in err


@pytest.fixture
def backed_huge(tmp_path):
    """A checkpoint whose rank file really holds a 2^40-element parameter (a sparse file of
    12 TiB that takes no disk), so the claim passes every check of the files and reaches the
    memory check: its exp_avg alone needs 4 TiB."""
    ck = tmp_path / "huge"
    torch.manual_seed(0)
    _save(ck, torch.nn.Linear(4, 3, bias=False))
    n, rank = 2**40, ck / "rank00000.safetensors"
    _, header_meta = format.read_header(str(rank))  # the save's identity, kept
    header, sizes = format.safetensors_header(
        [(k, torch.float32, [n]) for k in ("master", "exp_avg", "exp_avg_sq")], header_meta
    )
    try:
        with open(rank, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(sizes))
    except OSError as exc:  # a filesystem without sparse files this large
        pytest.skip(f"cannot make a 12 TiB sparse file here: {exc}")

    def edit(meta):
        meta["params"]["weight"]["shape"] = [2**20, 2**20]
        meta["files"][0]["pieces"] = [["weight", 0, n, "state", 0]]
        meta["files"][0]["bytes"] = os.path.getsize(rank)

    edit_meta(ck, edit)
    return ck


def test_parameter_larger_than_memory_is_refused(backed_huge, tmp_path, capsys):
    ck = backed_huge

    def state():  # the rank file cannot be hashed whole: its size, times and first bytes
        p = ck / "rank00000.safetensors"
        with open(p, "rb") as f:
            head = f.read(1 << 16)
        return (ck / "meta.json").read_bytes(), os.stat(p).st_size, os.stat(p).st_mtime_ns, head

    before = state()
    out, opt = tmp_path / "model.safetensors", tmp_path / "adamw.pt"
    argv = [str(ck), str(out), "--optimizer", str(opt), "--no-verify"]
    assert cli.main(argv) == 1
    assert state() == before and no_partial(tmp_path) and not out.exists()
    err = capsys.readouterr().err
    assert "error: not enough memory" in err and "exp_avg of 'weight'" in err
    assert f"({4 * 2**40} bytes)" in err and "Traceback" not in err


def test_memory_check_names_the_largest_allocation(ck, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "available_memory", lambda: 10)  # its exp_avg: 48 bytes
    argv = [str(ck), str(tmp_path / "m.safetensors"), "--optimizer", str(tmp_path / "o.pt")]
    err = refused(capsys, ck, tmp_path, argv)
    assert "error: not enough memory" in err and "'0.weight'" in err and "(10 bytes)" in err


def test_full_disk_is_refused_before_writing(ck, tmp_path, capsys, monkeypatch):
    free = shutil.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda path: free)
    out = tmp_path / "model.safetensors"
    argv = [str(ck), str(out), "--optimizer", str(tmp_path / "adamw.pt")]
    err = refused(capsys, ck, tmp_path, argv)
    assert "error: not enough disk space in" in err and "(1000 bytes) is free" in err
    assert "OUT " in err and "--optimizer " in err and "the largest tensor: '0.weight'" in err
    assert not out.exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("which", ["OUT", "--optimizer"])
def test_disk_full_while_writing_leaves_no_partial(ck, tmp_path, capsys, which):
    # A real ENOSPC: the .partial file each output is first written to is a link to /dev/full
    # (the space check passes; the writes fail). Python's files raise OSError, torch's zip
    # writer a RuntimeError: both must end as one line, with the .partial removed.
    out, opt = tmp_path / "model.safetensors", tmp_path / "adamw.pt"
    target = out if which == "OUT" else opt
    (tmp_path / (target.name + ".partial")).symlink_to("/dev/full")
    err = refused(capsys, ck, tmp_path, [str(ck), str(out), "--optimizer", str(opt)])
    assert f"error: writing {target} failed" in err and "partial file was removed" in err
    assert not (tmp_path / (target.name + ".partial")).is_symlink()
    assert not opt.exists()


def test_enospc_from_a_write_leaves_no_partial(ck, tmp_path, capsys, monkeypatch):
    import errno

    def full(self, name, chunk):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(format.StreamWriter, "write", full)
    out = tmp_path / "model.safetensors"
    err = refused(capsys, ck, tmp_path, [str(ck), str(out)])
    assert f"error: writing {out} failed: [Errno 28]" in err and not out.exists()


def test_interrupt_while_writing_leaves_no_partial(ck, tmp_path, capsys, monkeypatch):
    def interrupted(self, name, what):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli._Source, "full", interrupted)  # while writing the optimizer file
    argv = [str(ck), str(tmp_path / "m.safetensors"), "--optimizer", str(tmp_path / "o.pt")]
    err = refused(capsys, ck, tmp_path, argv, status=130)
    assert "interrupted" in err and not (tmp_path / "o.pt").exists()


def test_command_line_exit_status_and_one_line_error(ck, tmp_path):
    # The report's case: a traceback and exit status 1 from deep inside; now one line.
    claim_huge_weight(ck)
    before = digests(ck)
    out, opt = tmp_path / "model.safetensors", tmp_path / "adamw.pt"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerokern",
            "consolidate",
            str(ck),
            str(out),
            "--optimizer",
            str(opt),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("consolidate: error: ") and r.stderr.count("\n") == 1
    assert "'0.weight'" in r.stderr and str(HUGE) in r.stderr
    assert digests(ck) == before and no_partial(tmp_path) and not out.exists()


# -- a good output --------------------------------------------------------------------------------
def test_output_loads_with_weights_only(saved, ck, tmp_path, capsys):
    out, opt = tmp_path / "model.safetensors", tmp_path / "adamw.pt"
    before = digests(ck)
    assert cli.main([str(ck), str(out), "--optimizer", str(opt)]) == 0
    assert digests(ck) == before and no_partial(tmp_path)
    assert capsys.readouterr().out.startswith(f"wrote {out} (5 tensors")
    sd = st.load_file(str(out))
    assert sd.keys() == saved[1].keys()
    for k, v in saved[1].items():
        assert torch.equal(sd[k], v), k
    state = torch.load(str(opt), weights_only=True)  # the docstring's way of loading it
    assert sorted(state["state"]) == [0, 1, 2, 3]
    assert state["state"][0]["exp_avg"].shape == (3, 4)
    assert state["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert "weights_only=True" in cli.__doc__
