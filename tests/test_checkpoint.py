"""Checkpoints: save at one world size and stage, load at another; bitwise continuation at the
same configuration (16-bit parameters re-derived from the fp32 master); crashes and corruption
at every step of a save; consolidation into a plain state dict + torch.optim.AdamW.

Every rank trains on its slice of one global batch of 12 sequences per step (12 divides by 1,
2, 3 and 4), so the averaged gradient, and hence the run, is the same at every world size up to
the order of the fp32 sums."""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from models import Block, TinyGPT, batch

import zerokern
from zerokern.checkpoint import CheckpointError, format, load_checkpoint, save_checkpoint
from zerokern.cli import consolidate as cli

st = pytest.importorskip("safetensors.torch")  # the [checkpoint] extra

GLOBAL = 12
SAVE_AT = 3
RESHARD = dict(rtol=0.0, atol=1e-6)  # fp32, after resharding: only the sum order differs


def build(stage, *, seed=0, dtype=torch.float32, lr=1e-2, **kw):
    torch.manual_seed(seed)
    model = TinyGPT()
    with torch.no_grad():
        model.ln_f.bias.uniform_(-0.5, 0.5)
    model.ln_f.bias.requires_grad_(False)  # a frozen parameter
    model.register_buffer("seen", torch.zeros(2, dtype=torch.int64) + seed)
    model = model.to(dtype)
    decay = {n for n, p in model.named_parameters() if p.dim() >= 2}
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(Block,))
    else:
        kw.setdefault("bucket_numel", 96)  # parameters straddle buckets and shards
    groups = [
        dict(params=[p for n, p in model.named_parameters() if n in decay]),
        dict(params=[p for n, p in model.named_parameters() if n not in decay], weight_decay=0.0),
    ]
    opt = zerokern.ZeroAdamW(groups, lr=lr, weight_decay=0.1, stage=stage, **kw)
    return model, opt


def train(model, opt, start, steps, rank=0, world=1):
    k = GLOBAL // world
    for step in range(start, start + steps):
        x, y = batch(step, 0, n=GLOBAL)
        loss = F.cross_entropy(
            model(x[rank * k : (rank + 1) * k]).float(), y[rank * k : (rank + 1) * k]
        )
        getattr(opt, "scale_loss", lambda v: v)(loss).backward()
        opt.step()
        opt.zero_grad()
        model.seen += 1


def full(model):
    return zerokern.full_state_dict(model, rank0_only=False)


def assert_states(a, b, **tol):
    assert a.keys() == b.keys()
    for k in a:
        if tol and a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], **tol, msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert torch.equal(a[k], b[k]), k


# -- save at world 4, stage 3; the uninterrupted run is the reference ---------------------------
def _save_world4(rank, world, root):
    model, opt = build(3)
    train(model, opt, 0, SAVE_AT, rank, world)
    save_checkpoint(os.path.join(root, "ck"), model, opt, extra={"step": SAVE_AT})
    ref = {"at_save": full(model)}
    train(model, opt, SAVE_AT, 3, rank, world)
    ref["plus3"] = full(model)
    train(model, opt, SAVE_AT + 3, 2, rank, world)
    ref["plus5"] = full(model)
    if rank == 0:
        torch.save(ref, os.path.join(root, "ref.pt"))


@pytest.fixture(scope="module")
def ckpt4(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt4")
    run_ranks(4, _save_world4, str(root), tmp_path=root)
    return str(root)


def _resume(rank, world, root, stage):
    model, opt = build(stage, seed=123, lr=0.5)  # everything differs until loaded
    assert load_checkpoint(os.path.join(root, "ck"), model, opt) == {"step": SAVE_AT}
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-2]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    ref = torch.load(os.path.join(root, "ref.pt"))
    assert_states(full(model), ref["at_save"])  # fp32 values come back exactly
    train(model, opt, SAVE_AT, 5, rank, world)
    assert_states(full(model), ref["plus5"], **RESHARD)


def test_files_of_world4_stage3(ckpt4):
    ck = os.path.join(ckpt4, "ck")
    meta = json.load(open(os.path.join(ck, "meta.json")))
    assert sorted(os.listdir(ck)) == ["meta.json"] + [format.rank_file(r) for r in range(4)]
    assert meta["world_size"] == 4 and meta["stage"] == 3 and meta["extra"] == {"step": SAVE_AT}
    assert meta["aliases"] == {"head.weight": "emb.weight"}
    assert meta["params"]["ln_f.bias"]["managed"] is False
    assert meta["params"]["emb.weight"]["step"] == SAVE_AT
    # Each rank wrote only its 1/4: the optimizer state of all files adds up to the model once.
    trained = sum(torch.Size(p["shape"]).numel() for p in meta["params"].values() if p["managed"])
    saved = [st.load_file(os.path.join(ck, f["name"]))["master"].numel() for f in meta["files"]]
    assert sum(saved) == trained and max(saved) < trained / 2


def test_world4_stage3_to_world3_stage2(ckpt4, tmp_path):
    run_ranks(3, _resume, ckpt4, 2, tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [0, 2])
def test_world4_stage3_to_one_plain_process(ckpt4, stage):
    _resume(0, 1, ckpt4, stage)


def test_stage2_to_stage3_and_stage0_one_process(tmp_path):
    """The other direction: frozen values saved whole by rank 0 land in a unit's slice."""
    model, opt = build(2)
    train(model, opt, 0, 2)
    save_checkpoint(tmp_path / "ck", model, opt)
    train(model, opt, 2, 3)
    for stage in (3, 0):
        model2, opt2 = build(stage, seed=11)
        load_checkpoint(tmp_path / "ck", model2, opt2)
        train(model2, opt2, 2, 3)
        assert_states(full(model2), full(model), **RESHARD)


def _two_ranks(rank, world, root):
    _resume(rank, world, root, 3)  # stage 3 again, other world size: frozen slices move too
    _resume(rank, world, root, 1)
    # A write that fails on one rank: every rank raises, the previous checkpoint stays.
    model, opt = build(2)
    ck = os.path.join(root, "fail")
    save_checkpoint(ck, model, opt, extra="old")
    real = format.StreamWriter.write

    def failing(self, name, chunk):
        if rank == 1:
            raise OSError("No space left on device (simulated)")
        return real(self, name, chunk)

    format.StreamWriter.write = failing
    try:
        with pytest.raises(CheckpointError, match="rank 1.*No space left"):
            save_checkpoint(ck, model, opt, extra="new")
    finally:
        format.StreamWriter.write = real
    assert load_checkpoint(ck, model, opt) == "old"
    assert format.siblings(ck) == []


def test_reshard_to_world2_stage3_and_stage1_and_failing_rank(ckpt4, tmp_path):
    run_ranks(2, _two_ranks, ckpt4, tmp_path=tmp_path)


# -- bitwise at the same world size and stage ---------------------------------------------------
VARIANTS = [  # 16-bit params: a bitwise match shows they are exactly RNE(master)
    dict(stage=0, dtype=torch.bfloat16),
    dict(stage=2, dtype=torch.bfloat16, max_grad_norm=0.5),
    dict(stage=2, dtype=torch.float32),
    dict(stage=3, dtype=torch.float16, loss_scale="dynamic"),
]


def _bitwise(rank, world, root):
    for i, kw in enumerate(VARIANTS):
        ck = os.path.join(root, f"bw{i}")
        model, opt = build(**kw)
        if opt.scaler is not None:
            opt.scaler.scale, opt.scaler.growth_interval = 2.0**8, 2  # grows during the run
        train(model, opt, 0, SAVE_AT, rank, world)
        save_checkpoint(ck, model, opt, extra={"variant": i})
        train(model, opt, SAVE_AT, 4, rank, world)
        model2, opt2 = build(**kw, seed=7)
        assert load_checkpoint(ck, model2, opt2) == {"variant": i}
        train(model2, opt2, SAVE_AT, 4, rank, world)
        assert_states(full(model), full(model2))
        s1, s2 = opt.state_dict(), opt2.state_dict()
        for k, v in s1["state"].items():
            assert (v is None and s2["state"][k] is None) or torch.equal(v, s2["state"][k]), k
        assert s1["scaler"] == s2["scaler"] and s1["param_groups"] == s2["param_groups"]


def test_bitwise_continuation_same_config(tmp_path):
    run_ranks(2, _bitwise, str(tmp_path), tmp_path=tmp_path)


# -- crashes and corruption (one plain process) --------------------------------------------------
class Killed(BaseException):
    """A simulated kill: not an Exception, so save_checkpoint cleans nothing up."""


def _small(tmp_path, extra="old"):
    model, opt = build(2)
    train(model, opt, 0, 2)
    ck = str(tmp_path / "ck")
    save_checkpoint(ck, model, opt, extra=extra)
    return model, opt, ck


def _params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_kill_while_writing_a_rank_file_keeps_previous(tmp_path, monkeypatch):
    model, opt, ck = _small(tmp_path)
    train(model, opt, 2, 1)
    real, calls = format.StreamWriter.write, []

    def dies(self, name, chunk):
        calls.append(name)
        if len(calls) == 2:
            raise Killed
        return real(self, name, chunk)

    monkeypatch.setattr(format.StreamWriter, "write", dies)
    with pytest.raises(Killed):
        save_checkpoint(ck, model, opt, extra="new")
    monkeypatch.undo()
    (left,) = format.siblings(ck)  # the incomplete new one: a partial file and no meta.json
    # its owner marker is left too: the save is gone, so its lock is free (abandoned)
    assert sorted(os.listdir(left)) == [".owner", "rank00000.safetensors.partial"]
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        load_checkpoint(left, model, opt)
    assert load_checkpoint(ck, model, opt) == "old"
    save_checkpoint(ck, model, opt, extra="next")  # and the next save clears the debris
    assert format.siblings(ck) == [] and load_checkpoint(ck, model, opt) == "next"


def test_write_error_raises_and_keeps_previous(tmp_path, monkeypatch):
    model, opt, ck = _small(tmp_path)
    monkeypatch.setattr(format.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "EIO")))
    with pytest.raises(CheckpointError, match="EIO"):
        save_checkpoint(ck, model, opt, extra="new")
    monkeypatch.undo()
    assert format.siblings(ck) == [] and load_checkpoint(ck, model, opt) == "old"


def test_kill_before_publish_keeps_previous(tmp_path, monkeypatch):
    model, opt, ck = _small(tmp_path)
    from zerokern.checkpoint import save as save_mod

    monkeypatch.setattr(save_mod, "publish", lambda *a: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        save_checkpoint(ck, model, opt, extra="new")
    monkeypatch.undo()
    assert load_checkpoint(ck, model, opt) == "old"


def test_kill_between_the_two_renames_recovers_newest(tmp_path, monkeypatch):
    """Without RENAME_EXCHANGE, publish renames old away, then new in place."""
    model, opt, ck = _small(tmp_path)
    real, n = os.rename, []

    def rename(a, b):
        n.append(a)
        if len(n) == 2:
            raise Killed
        return real(a, b)

    monkeypatch.setattr(format, "_exchange", lambda a, b: False)
    monkeypatch.setattr(format.os, "rename", rename)
    with pytest.raises(Killed):
        save_checkpoint(ck, model, opt, extra="new")
    monkeypatch.undo()
    assert not os.path.exists(ck) and len(format.siblings(ck)) == 2  # .old- and .tmp-
    assert load_checkpoint(ck, model, opt) == "new"
    save_checkpoint(ck, model, opt, extra="next")
    assert format.siblings(ck) == [] and load_checkpoint(ck, model, opt) == "next"


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "delete", "meta"])
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    _, _, ck = _small(tmp_path)
    f = os.path.join(ck, "rank00000.safetensors")
    size = os.path.getsize(f)
    if damage == "truncate":
        os.truncate(f, size - 100)
        match = "rank00000.safetensors is truncated"
    elif damage == "flip":
        with open(f, "r+b") as fh:
            fh.seek(size - 10)
            b = fh.read(1)
            fh.seek(size - 10)
            fh.write(bytes([b[0] ^ 1]))
        match = "rank00000.safetensors is corrupt.*sha256"
    elif damage == "header":
        with open(f, "r+b") as fh:
            fh.write(b"\xff" * 8)
        match = "rank00000.safetensors is corrupt"
    elif damage == "delete":
        os.unlink(f)
        match = "rank00000.safetensors is missing"
    else:
        os.unlink(os.path.join(ck, "meta.json"))
        match = "meta.json is missing"
    model, opt = build(2, seed=5)
    before = _params(model)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ck, model, opt)
    assert_states(_params(model), before)  # untouched
    assert all(sh.step == 0 for sh in opt.shards())


def test_mismatched_model_and_bad_arguments_are_refused(tmp_path):
    model, opt, ck = _small(tmp_path)
    other = TinyGPT(dim=15)
    oopt = zerokern.ZeroAdamW(other.parameters(), stage=2)
    before = _params(other)
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(ck, other, oopt)
    assert_states(_params(other), before)
    with pytest.raises(CheckpointError, match="extra must be JSON"):
        save_checkpoint(ck, model, opt, extra=object())
    # nanoGPT's best_val_loss is a 0-d tensor: the entry is named, with what to pass instead
    with pytest.raises(CheckpointError, match=r"extra\['best_val_loss'\] is a Tensor\).*"
                                              r"float\(extra\['best_val_loss'\]\)"):
        save_checkpoint(ck, model, opt, extra={"iter_num": 1, "best_val_loss": torch.tensor(2.0)})
    with pytest.raises(CheckpointError, match=r"extra\['t'\] is a Tensor\)$"):  # no float() hint
        save_checkpoint(ck, model, opt, extra={"t": torch.ones(2)})
    loop: dict = {"iter_num": 1}
    loop["self"] = loop  # json's own message, not a RecursionError
    with pytest.raises(CheckpointError, match="Circular reference"):
        save_checkpoint(ck, model, opt, extra=loop)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="not a zerokern checkpoint"):
        save_checkpoint(tmp_path / "mine", model, opt)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert load_checkpoint(ck, model, opt) == "old"


# -- consolidation ------------------------------------------------------------------------------
def test_consolidate_into_plain_model_and_adamw(ckpt4, tmp_path, capsys):
    out, out_opt = str(tmp_path / "model.safetensors"), str(tmp_path / "adamw.pt")
    assert cli.main([os.path.join(ckpt4, "ck"), out, "--optimizer", out_opt]) == 0
    ref = torch.load(os.path.join(ckpt4, "ref.pt"))
    sd = st.load_file(out)
    model, zopt = build(0, seed=9)
    del zopt  # torch's AdamW trains this model: no ZeroAdamW may act on its gradients
    gc.collect()
    model.load_state_dict(sd)  # strict: every key, tied head.weight and the buffer included
    assert_states(_params(model), ref["at_save"])
    decay = {n for n, p in model.named_parameters() if p.dim() >= 2}
    adamw = torch.optim.AdamW(
        [
            dict(params=[p for n, p in model.named_parameters() if n in decay]),
            dict(params=[p for n, p in model.named_parameters() if n not in decay]),
        ],
        lr=0.5,
        foreach=False,
    )  # lr and weight decay come from the file
    adamw.load_state_dict(torch.load(out_opt, weights_only=True))
    assert cli.adamw_defaults() == {
        k: v
        for k, v in torch.optim.AdamW([torch.zeros(1)]).param_groups[0].items()
        if k != "params"
    }
    assert adamw.param_groups[1]["weight_decay"] == 0.0 and adamw.param_groups[0]["lr"] == 1e-2
    train(model, adamw, SAVE_AT, 3)
    assert_states(_params(model), ref["plus3"], **RESHARD)
    # A broken checkpoint: exit status 1 and a message naming the file.
    bad = tmp_path / "bad"
    model, opt = build(2)
    save_checkpoint(bad, model, opt)
    os.truncate(bad / "rank00000.safetensors", 64)
    assert cli.main([str(bad), str(tmp_path / "x.safetensors")]) == 1
    assert "rank00000.safetensors is truncated" in capsys.readouterr().err


def test_streaming_writers_match_the_reference_formats(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(4).to(torch.bfloat16),
        "e": torch.zeros(0),
        "s": torch.tensor(2.0),
    }
    entries = sorted(
        ((k, v.dtype, v.shape) for k, v in tensors.items()),
        key=lambda e: -torch.empty(0, dtype=e[1]).element_size(),
    )
    w = format.StreamWriter(str(tmp_path / "t.safetensors"), entries, {"k": "v"})
    for k, _, _ in entries:
        t = tensors[k].reshape(-1)
        for a in range(0, t.numel(), 2):  # in chunks
            w.write(k, t[a : a + 2])
    w.close()
    got = st.load_file(str(tmp_path / "t.safetensors"))
    assert_states(got, tensors)
    obj = {
        "state": {
            0: {
                "step": torch.tensor(3.0),
                "m": cli.LazyTensor((3, 5), torch.float32, lambda: tensors["a"]),
            }
        },
        "groups": [{"betas": (0.9, 0.99), "params": [0]}],
    }
    cli.stream_torch_save(obj, str(tmp_path / "o.pt"))
    back = torch.load(str(tmp_path / "o.pt"), weights_only=True)
    assert torch.equal(back["state"][0]["m"], tensors["a"])
    assert back["state"][0]["step"].item() == 3.0 and back["groups"][0]["betas"] == (0.9, 0.99)
