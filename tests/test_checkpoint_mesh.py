"""Checkpoints and hybrid sharding (issue 28): a checkpoint moves between flat and 2-D mesh
layouts and world sizes, and a save on a mesh is one collective of the whole mesh.

The chain, per stage (1-3) and state (fp32; bf16 parameters with int8 moments and no master,
reduced in fp32): saved flat at world 4 -> loaded on a 2 x 2 mesh -> saved there -> loaded flat
at world 2 -> saved -> loaded on a 3 x 1 mesh (world 3) -> saved -> loaded flat at world 3.
After every load the run goes on for two steps and must equal, bit for bit (parameters,
buffers and every stored buffer of the optimizer state, int8 codes and absmax included), an
uninterrupted run at that layout started from the same initial model: so the load restored
exactly the state that layout would have had, and its continuation is exact.

Why bitwise across world sizes: rank r's gradient is G_t + c_r E_t with integers over 64 below
4 in magnitude (8 significant bits: exact in bf16) and c_r in {-1, 0, 1} summing to 0 over the
ranks, so the sum over any N ranks is N G_t exactly in fp32, in any order, and the average
(one division by N) is G_t exactly: the same gradient at every layout. The AdamW step is
elementwise, int8 blocks are each parameter's own and the stochastic rounding is keyed by the
element's index in its parameter (issue 27), so the run does not depend on the layout either.

On a mesh only the first replica writes (one file per shard rank; the others' writers are
made to fail if called), and the replicas end a load with the same state. Errors on one rank
of the mesh (a writer, a rank of another replica that writes nothing, the publishing rank; a
corrupt file that only one rank hashes on load) raise CheckpointError on every rank, the
previous checkpoint stays and nothing of the model or optimizer changes.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import zerokern
from zerokern.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from zerokern.checkpoint import save as save_mod
from zerokern.checkpoint.format import META, rank_file

pytest.importorskip("safetensors")

_MESHES: dict[tuple[int, int], DeviceMesh] = {}
STATES = {
    "fp32": (torch.float32, {}),
    "int8": (torch.bfloat16, {"moments": "int8", "master": "none",
                              "reduce_dtype": torch.float32}),
}


def _mesh(shape: tuple[int, int]) -> DeviceMesh:
    """This rank process's mesh of ``shape``, built once (building one is a collective that
    creates process groups; the rank pool lives across tests)."""
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return _MESHES[shape]


class SplitGradNet(nn.Module):
    """Loss linear in every parameter: rank r of N gets the gradient G_t + c_r E_t (see the
    module docstring), the same average at every world size. ``big`` is large enough for int8
    moments (4,096 elements or more), ``d`` is used on even steps only, ``frozen`` is not
    trained and ``seen`` is a buffer the loop changes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(37, 13))
        self.big = nn.Parameter(torch.randn(65, 67))
        self.b = nn.Parameter(torch.randn(29))
        self.d = nn.Parameter(torch.randn(7))
        self.frozen = nn.Parameter(torch.randn(11), requires_grad=False)
        self.register_buffer("seen", torch.zeros(3, dtype=torch.int64))

    def forward(self, step: int) -> torch.Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        c = 0 if world % 2 and rank == world - 1 else (1 if rank % 2 == 0 else -1)
        gg = torch.Generator().manual_seed(7919 * step)
        ge = torch.Generator().manual_seed(7919 * step + 104729)
        loss = torch.zeros((), dtype=torch.float32)
        for name in ("a", "big", "b", "d"):
            p = getattr(self, name)
            g = torch.randint(-127, 128, p.shape, generator=gg)
            e = torch.randint(-127, 128, p.shape, generator=ge)
            if name == "d" and step % 2:
                continue
            loss = loss + (p * ((g + c * e).to(p.dtype) / 64)).sum().float()
        return loss


def _build(seed: int, stage: int, state: str,
           mesh: DeviceMesh | None) -> tuple[nn.Module, Any]:
    dtype, kw = STATES[state]
    torch.manual_seed(seed)
    model = SplitGradNet().to(dtype)
    if stage == 3:
        model = zerokern.shard_model(model, mesh=mesh)
    opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, mesh=mesh, lr=1e-2,
                             betas=(0.9, 0.95), weight_decay=0.05, bucket_numel=300, **kw)
    return model, opt


def _train(model: nn.Module, opt: Any, start: int, stop: int) -> None:
    for step in range(start, stop):
        model(step).backward()
        opt.step()
        opt.zero_grad()
        model.seen += 1


def _params(model: nn.Module, stage: int) -> dict[str, torch.Tensor]:
    if stage == 3:
        return zerokern.full_state_dict(model, rank0_only=False)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _bits_equal(a: Any, b: Any, where: str) -> None:
    """``a`` and ``b`` hold the same bits (tensors) or values (the rest), recursively."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), \
            where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a.keys()} {b.keys()}"
        for k in a:
            _bits_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _bits_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _same_run(model: nn.Module, opt: Any, ref: nn.Module, ropt: Any, stage: int,
              what: str) -> None:
    """Parameters, buffers and this rank's optimizer state (every stored buffer) equal the
    reference run's, bit for bit."""
    _bits_equal(_params(model, stage), _params(ref, stage), f"{what}: model")
    _bits_equal(dict(model.named_buffers()), dict(ref.named_buffers()), f"{what}: buffers")
    _bits_equal(opt.state_dict(), ropt.state_dict(), f"{what}: optimizer state")


def _replicas_agree(opt: Any) -> None:
    """Every replica of a shard rank holds the same optimizer state (the ranks of one shard
    group differ: they hold different shards)."""
    mine = (opt.comm.rank, opt.state_dict()["state"])
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for shard, state in everyone:
        if shard == mine[0]:
            _bits_equal(state, mine[1], f"replica of shard rank {shard}")


def _continue(root: str, src: str, dst: str | None, stage: int, state: str,
              mesh: DeviceMesh | None, at: int) -> None:
    """Load ``src`` (saved at step ``at``) into a model of another seed at this layout, train
    two steps, check against the uninterrupted run at this layout, save to ``dst``."""
    model, opt = _build(1, stage, state, mesh)  # every value differs until loaded
    assert load_checkpoint(os.path.join(root, src), model, opt) == {"step": at}
    if mesh is not None:
        _replicas_agree(opt)
    _train(model, opt, at, at + 2)
    ref, ropt = _build(0, stage, state, mesh)
    _train(ref, ropt, 0, at + 2)
    _same_run(model, opt, ref, ropt, stage, f"{src} -> {dst}")
    if dst is not None:
        _save_as_writer_or_not(os.path.join(root, dst), model, opt, {"step": at + 2})


def _save_as_writer_or_not(path: str, model: nn.Module, opt: Any, extra: Any) -> None:
    """save_checkpoint, with the file writer of every replica but the first made to fail:
    they must not write."""
    rep = opt.comm.replicate
    if rep is None or rep.rank == 0:
        save_checkpoint(path, model, opt, extra=extra)
        return

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError(f"replica {rep.rank} wrote a rank file")

    real, save_mod.write_rank_file = save_mod.write_rank_file, refuse
    try:
        save_checkpoint(path, model, opt, extra=extra)
    finally:
        save_mod.write_rank_file = real


def _files(path: str) -> tuple[list[str], dict[str, Any]]:
    with open(os.path.join(path, META)) as f:
        return sorted(os.listdir(path)), json.load(f)


def _link4(rank: int, world: int, root: str, stage: int, state: str) -> None:
    """Flat at 4, saved at step 2; loaded on 2 x 2, trained to 4 and saved there."""
    model, opt = _build(0, stage, state, None)
    _train(model, opt, 0, 2)
    save_checkpoint(os.path.join(root, "flat4"), model, opt, extra={"step": 2})
    names, meta = _files(os.path.join(root, "flat4"))
    assert names == [META] + [rank_file(r) for r in range(4)] and "mesh" not in meta
    _continue(root, "flat4", "mesh2x2", stage, state, _mesh((2, 2)), 2)
    # The uninterrupted flat run from the save equals it too (another layout, the same bits).
    _train(model, opt, 2, 4)
    loaded, lopt = _build(1, stage, state, None)
    load_checkpoint(os.path.join(root, "mesh2x2"), loaded, lopt)
    _same_run(loaded, lopt, model, opt, stage, "mesh2x2 -> flat 4")
    if stage == 3:  # weights only, into a model sharded over the mesh: each reads its slices
        dtype = STATES[state][0]
        torch.manual_seed(1)
        bare = zerokern.shard_model(SplitGradNet().to(dtype), mesh=_mesh((2, 2)))
        assert load_checkpoint(os.path.join(root, "mesh2x2"), bare, None) == {"step": 4}
        _bits_equal(_params(bare, 3), _params(model, 3), "weights only on the mesh")
    names, meta = _files(os.path.join(root, "mesh2x2"))
    assert names == [META, rank_file(0), rank_file(1)], names
    assert meta["world_size"] == 2 and meta["mesh"] == {"shape": [2, 2],
                                                        "dim_names": ["replicate", "shard"]}


def _link2(rank: int, world: int, root: str, stage: int, state: str) -> None:
    _continue(root, "mesh2x2", "flat2", stage, state, None, 4)


def _link3(rank: int, world: int, root: str, stage: int, state: str) -> None:
    _continue(root, "flat2", "mesh3x1", stage, state, _mesh((3, 1)), 6)
    names, meta = _files(os.path.join(root, "mesh3x1"))
    assert names == [META, rank_file(0)] and meta["mesh"]["shape"] == [3, 1], (names, meta)
    _continue(root, "mesh3x1", None, stage, state, None, 8)


@pytest.mark.parametrize("state", ["fp32", "int8"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_flat_and_mesh_layouts_across_world_sizes(stage, state, tmp_path):
    run_ranks(4, _link4, str(tmp_path), stage, state, tmp_path=tmp_path)
    run_ranks(2, _link2, str(tmp_path), stage, state, tmp_path=tmp_path)
    run_ranks(3, _link3, str(tmp_path), stage, state, tmp_path=tmp_path)


# -- a save and a load on a mesh are collectives of the whole mesh -------------------------------
def _raise_on(rank_is: bool, module: Any, attr: str, error: BaseException) -> Any:
    """Replace ``module.attr`` by a function raising ``error`` on this rank if ``rank_is``;
    returns the restorer."""
    real = getattr(module, attr)
    if rank_is:
        def fail(*a: object, **k: object) -> None:
            raise error
        setattr(module, attr, fail)
    return lambda: setattr(module, attr, real)


def _errors(rank: int, world: int, root: str) -> None:
    mesh = _mesh((2, 2))
    model, opt = _build(0, 2, "fp32", mesh)
    _train(model, opt, 0, 2)
    path = os.path.join(root, "ck")
    save_checkpoint(path, model, opt, extra={"v": 1})
    with open(os.path.join(path, META), "rb") as f:
        published = f.read()
    listing = sorted(os.listdir(root))
    dist.barrier()  # no rank stages the next save before every rank has looked
    replica, shard = opt.comm.replicate.rank, opt.comm.rank
    cases = [
        # a writer's file fails (replica 0, shard rank 1)
        ((0, 1), "write_rank_file", OSError(28, "No space left on device (test)"),
         {"v": 2}, "(on replica 0, shard rank 1): OSError"),
        # the publishing rank fails after every file is written: nobody returns before it
        ((0, 0), "publish", OSError(5, "Input/output error (test)"),
         {"v": 2}, "(on replica 0, shard rank 0): OSError"),
    ]
    for who, attr, error, extra, words in cases:
        restore = _raise_on((replica, shard) == who, save_mod, attr, error)
        try:
            with pytest.raises(CheckpointError) as info:
                save_checkpoint(path, model, opt, extra=extra)
        finally:
            restore()
        assert words in str(info.value) and str(error) in str(info.value), str(info.value)
        with open(os.path.join(path, META), "rb") as f:
            assert f.read() == published, attr  # the previous checkpoint stays
        assert sorted(os.listdir(root)) == listing, (attr, os.listdir(root))  # nothing left
        dist.barrier()
    # a rank of the second replica, which writes nothing, fails its plan
    with pytest.raises(CheckpointError, match=r"\(on replica 1, shard rank 0\): TypeError: "
                                              "extra must be JSON"):
        save_checkpoint(path, model, opt,
                        extra=object() if (replica, shard) == (1, 0) else {"v": 2})
    assert sorted(os.listdir(root)) == listing
    with open(os.path.join(path, META), "rb") as f:
        assert f.read() == published
    dist.barrier()
    # A load: rank00001 is hashed by the mesh's rank 1 only (replica 0, shard rank 1); a
    # flipped byte there is raised on every rank, before anything changes.
    other, oopt = _build(1, 2, "fp32", mesh)
    _train(other, oopt, 0, 1)
    before = copy.deepcopy((_params(other, 2), oopt.state_dict()))
    if dist.get_rank() == 0:
        victim = os.path.join(path, rank_file(1))
        with open(victim, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            b = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x10]))
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"\(on replica 0, shard rank 1\): rank00001"
                                              r"\.safetensors is corrupt"):
        load_checkpoint(path, other, oopt)
    _bits_equal((_params(other, 2), oopt.state_dict()), before, "after a refused load")
    # and a save over it still works, the files written by the first replica alone
    _save_as_writer_or_not(path, model, opt, {"v": 3})
    assert load_checkpoint(path, other, oopt) == {"v": 3}
    _same_run(other, oopt, model, opt, 2, "resaved")


def test_mesh_save_and_load_errors_raise_on_every_rank(tmp_path):
    run_ranks(4, _errors, str(tmp_path), tmp_path=tmp_path)


# -- meta.json's mesh entry: checked, never used to lay out ------------------------------------
def test_mesh_entry_is_informational_and_checked(tmp_path):
    """A one-process checkpoint given a mesh entry (digest recomputed) loads the same; a
    malformed entry, or one whose shard size is not the number of files, is refused by name."""
    from zerokern.checkpoint.format import META_DIGEST, meta_digest

    model, opt = _build(0, 2, "fp32", None)
    for step in range(2):
        model.a.sum().backward() if step else model.b.sum().backward()
        opt.step()
        opt.zero_grad()
    path = os.path.join(tmp_path, "ck")
    save_checkpoint(path, model, opt, extra={"step": 2})
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)

    def with_mesh(entry: Any) -> None:
        edited = {**meta, "mesh": entry}
        edited[META_DIGEST] = meta_digest(edited)
        with open(os.path.join(path, META), "w") as f:
            json.dump(edited, f)

    with_mesh({"shape": [5, 1], "dim_names": None})  # saved by 5 replicas of one rank
    other, oopt = _build(1, 2, "fp32", None)
    assert load_checkpoint(path, other, oopt) == {"step": 2}
    _same_run(other, oopt, model, opt, 2, "with a mesh entry")
    before = copy.deepcopy(_params(other, 2))
    for entry, words in [
        ({"shape": [2, 2], "dim_names": None}, r"mesh\.shape must be \[replicas, 1\]"),
        ({"shape": [2], "dim_names": None}, r"mesh\.shape must be \[replicas, shard ranks\]"),
        ({"shape": [2, 1], "dim_names": "rs"}, r"mesh\.dim_names must be null or two"),
        ({"shape": [2, 1]}, r"mesh lacks the entry 'dim_names'"),
        ([2, 1], r"mesh must be a JSON object"),
    ]:
        with_mesh(entry)
        with pytest.raises(CheckpointError, match=words):
            load_checkpoint(path, other, oopt)
    _bits_equal(_params(other, 2), before, "after the refused loads")
