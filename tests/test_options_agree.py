"""Options that must agree across ranks, and nothing modified before every check has passed
(issue 35): ZeroConfig.validate() and the one gathered comparison of zero/agreement.py.

Multi-rank cases run on gloo ranks (world 2; the seed also on a 2x2 mesh): each rank passes
its own value, and every rank must raise a ValueError that names the option and each rank's
value, at construction (before the first step, where different layouts would abort the
process inside gloo). Refused calls leave the model as it was, so the corrected call
succeeds on the same model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from models import Block, OddNet, TinyGPT, batch
from torch import nn

import zerokern
from zerokern import ZeroConfig
from zerokern.zero.agreement import verdict
from zerokern.zero.registry import runtime_of_module


def _model(dtype: torch.dtype = torch.bfloat16, stage: int = 2, mesh=None) -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT().to(dtype)
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(Block,), mesh=mesh)
    return model


def _refused_everywhere(build, *words: str) -> None:
    """``build()`` raises ValueError on this rank, naming every one of ``words``."""
    with pytest.raises(ValueError) as info:
        build()
    for w in words:
        assert w in str(info.value), f"{w!r} not in: {info.value}"


def _one_step(model: nn.Module, opt: zerokern.ZeroAdamW, rank: int) -> None:
    x, y = batch(0, rank)
    F.cross_entropy(model(x).float(), y).backward()
    opt.step()
    opt.zero_grad()


# -- items 1-3: the options that must agree --------------------------------------------------
def _differing_state_options(rank: int, world: int) -> None:
    """The silent differences of the issue, at every stage: a seed (master="none"), the
    master format, the moments format and its int8 version, each given differently by each
    rank."""
    cases = [
        (dict(master="none", seed=rank), ["seed is 0 on rank 0, 1 on rank 1"]),
        (dict(master="none" if rank == 0 else "fp32"),
         ["master is 'none' on rank 0, 'fp32' on rank 1"]),
        (dict(moments="int8" if rank == 0 else "fp32"),
         ["moments is 'int8' on rank 0, 'fp32' on rank 1"]),
        # The int8 format version: the same layout, other codes (replicas apart, shards in
        # two encodings).
        (dict(moments="int8", int8_format=2 + rank),
         ["int8_format is 2 on rank 0, 3 on rank 1"]),
    ]
    for stage in (0, 1, 2, 3):
        model = _model(torch.bfloat16, stage)
        for kw, words in cases:
            _refused_everywhere(
                lambda kw=kw, model=model, stage=stage: zerokern.ZeroAdamW(
                    model.parameters(), stage=stage, **kw),
                "ZeroAdamW: options differ across ranks", *words)
        # Nothing was changed by the refusals: the same options on every rank train.
        opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, master="none",
                                 moments="int8", seed=5)
        _one_step(model, opt, rank)


def test_seed_master_and_moments_must_agree_at_every_stage(tmp_path):
    run_ranks(2, _differing_state_options, tmp_path=tmp_path)


def _differing_options(rank: int, world: int) -> None:
    """Every other option that changes the collectives or the update, and per-group
    hyperparameters, one at a time; then several at once, all named in one error."""
    two = [  # (keyword, rank 0's value, rank 1's value, what the error says)
        ("stage", 1, 2, "stage is 1 on rank 0, 2 on rank 1"),
        ("bucket_numel", 64, 128, "bucket_numel is 64 on rank 0, 128 on rank 1"),
        ("offload", None, "cpu", "offload is None on rank 0, 'cpu' on rank 1"),
        ("reduce_dtype", None, torch.float32,
         "reduce_dtype is None on rank 0, 'torch.float32' on rank 1"),
        ("loss_scale", None, "dynamic", "loss_scale is None on rank 0, 'dynamic' on rank 1"),
        ("max_grad_norm", 1.0, 2, "max_grad_norm is 1.0 on rank 0, 2.0 on rank 1"),
        ("lr", 1e-3, 2e-3, "lr (param group 0) is 0.001 on rank 0, 0.002 on rank 1"),
        ("eps", 1e-8, 1e-6, "eps (param group 0) is 1e-08 on rank 0, 1e-06 on rank 1"),
        ("weight_decay", 0.0, 0.1,
         "weight_decay (param group 0) is 0.0 on rank 0, 0.1 on rank 1"),
        ("betas", (0.9, 0.99), (0.9, 0.999),
         "betas (param group 0) is (0.9, 0.99) on rank 0, (0.9, 0.999) on rank 1"),
    ]
    model = _model(torch.bfloat16)
    for name, a, b, words in two:
        kw = {"stage": 2, name: a if rank == 0 else b}
        _refused_everywhere(lambda kw=kw: zerokern.ZeroAdamW(model.parameters(), **kw), words)
    # stage 3 on one rank, 2 on the other, over a sharded model: rank 1's own refusal (a
    # sharded model needs stage=3) gives way to the difference that causes it.
    sharded = _model(torch.bfloat16, 3)
    _refused_everywhere(
        lambda: zerokern.ZeroAdamW(sharded.parameters(), stage=3 if rank == 0 else 2),
        "stage is 3 on rank 0, 2 on rank 1")
    # A second param group's learning rate.
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay}, {"params": other, "lr": 0.01 * (rank + 1)}]
    _refused_everywhere(lambda: zerokern.ZeroAdamW(groups, stage=1),
                        "lr (param group 1) is 0.01 on rank 0, 0.02 on rank 1")
    # Several at once: one error names them all.
    _refused_everywhere(
        lambda: zerokern.ZeroAdamW(model.parameters(), stage=1 + rank, seed=rank,
                                   bucket_numel=100 + rank),
        "stage is 1 on rank 0, 2 on rank 1", "bucket_numel is 100 on rank 0, 101 on rank 1",
        "seed is 0 on rank 0, 1 on rank 1")
    # add_param_group: the new group's hyperparameters are compared too, and a refused
    # group leaves the optimizer as it was.
    opt = zerokern.ZeroAdamW([{"params": decay}], stage=2)
    _refused_everywhere(lambda: opt.add_param_group({"params": other, "lr": 0.1 * (rank + 1)}),
                        "add_param_group: options differ across ranks",
                        "lr (param group 1) is 0.1 on rank 0, 0.2 on rank 1")
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": other, "lr": 0.1})
    # overlap_comm and backend are each rank's own: accepted.
    model = _model(torch.bfloat16)  # (the model above is managed by a live ZeroAdamW)
    opt = zerokern.ZeroAdamW(model.parameters(), stage=2, overlap_comm=rank == 0,
                             backend="torch" if rank else None)
    _one_step(model, opt, rank)


def test_every_option_that_must_agree_is_compared(tmp_path):
    run_ranks(2, _differing_options, tmp_path=tmp_path)


def _refused_on_one_rank(rank: int, world: int) -> None:
    """An argument refused on one rank only is raised on every rank (the other rank does
    not wait in a collective the refusing rank never joins)."""
    model = _model(torch.bfloat16)
    with pytest.raises(ValueError) as info:
        zerokern.ZeroAdamW(model.parameters(), stage=2,
                           moments="int4" if rank == 1 else "fp32")
    if rank == 1:
        assert str(info.value).startswith("moments must be one of"), str(info.value)
    else:
        assert "ZeroAdamW failed on rank 1: ValueError: moments must be one of" in \
            str(info.value), str(info.value)
    # A mesh on one rank, none on the other (built without its process groups: only one
    # rank makes it).
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [0, 1], _init_backend=False) if rank == 0 else None
    _refused_everywhere(lambda: zerokern.ZeroAdamW(model.parameters(), stage=2, mesh=mesh),
                        "mesh differs across ranks", "a mesh [0, 1] on rank 0",
                        "no mesh on rank 1")
    opt = zerokern.ZeroAdamW(model.parameters(), stage=2)
    _one_step(model, opt, rank)


def test_a_refusal_on_one_rank_is_raised_on_every_rank(tmp_path):
    run_ranks(2, _refused_on_one_rank, tmp_path=tmp_path)


_MESHES: dict[str, object] = {}


def _mesh_2x2():
    """This rank's 2x2 mesh, made once per rank process (its subgroups stay with the pool)."""
    if "2x2" not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES["2x2"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return _MESHES["2x2"]


def _mesh_seed(rank: int, world: int) -> None:
    """2x2 mesh (dim 0 replicate): the two replicas of one shard given different seeds."""
    mesh = _mesh_2x2()
    seed = rank // 2  # ranks 0, 1: replica 0; ranks 2, 3: replica 1
    for stage in (0, 2, 3):
        model = _model(torch.bfloat16, stage, mesh=mesh)
        _refused_everywhere(
            lambda model=model, stage=stage: zerokern.ZeroAdamW(
                model.parameters(), stage=stage, mesh=mesh, master="none", seed=seed),
            "seed is 0 on ranks 0-1, 1 on ranks 2-3")
        opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, mesh=mesh, master="none",
                                 seed=3)
        _one_step(model, opt, rank)


def test_seed_must_agree_across_replicas_on_a_2d_mesh(tmp_path):
    run_ranks(4, _mesh_seed, tmp_path=tmp_path)


def _parallelize_disagreeing(rank: int, world: int) -> None:
    """parallelize at stage 3 compares the options before shard_model changes the model."""
    model = _model(torch.bfloat16)
    _refused_everywhere(
        lambda: zerokern.parallelize(model, stage=3, unit_classes=(Block,), master="none",
                                     seed=rank),
        "parallelize: options differ across ranks", "seed is 0 on rank 0, 1 on rank 1")
    assert runtime_of_module(model) is None
    opt = zerokern.parallelize(model, stage=3, unit_classes=(Block,), master="none", seed=1)
    _one_step(model, opt, rank)


def test_parallelize_compares_before_it_shards(tmp_path):
    run_ranks(2, _parallelize_disagreeing, tmp_path=tmp_path)


# -- item 4: every option checked before parallelize touches the model -----------------------
@pytest.mark.parametrize("kw,match", [
    (dict(moments="int4"), "moments must be one of"),
    (dict(moments=None), "moments must be one of"),
    (dict(master="bf16"), "master must be one of"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*63\)"),
    (dict(seed=2**64), r"seed must be an int in \[0, 2\*\*63\)"),
    (dict(backend="fastest"), "backend must be one of"),
    (dict(reduce_dtype=torch.float16), "reduce_dtype must be None or torch.float32"),
    (dict(overlap_comm="yes"), "overlap_comm must be True or False"),
    (dict(stage=2.0), r"stage must be 0, 1, 2 or 3, got 2.0 \(a float"),
    (dict(config="stage 3"), "config must be a zerokern.ZeroConfig"),
])
def test_parallelize_refuses_before_sharding(kw, match):
    model = _model(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((ValueError, TypeError), match=match):
        zerokern.parallelize(model, **{"stage": 3, **kw})
    assert runtime_of_module(model) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    opt = zerokern.parallelize(model, stage=3, unit_classes=(Block,))  # the corrected call
    assert opt.stage == 3 and runtime_of_module(model) is not None


def test_parallelize_refuses_master_none_on_fp32_parameters_before_sharding():
    model = _model(torch.float32)
    with pytest.raises(ValueError, match="master='none' needs bf16 parameters"):
        zerokern.parallelize(model, stage=3, master="none")
    assert runtime_of_module(model) is None
    # named parameters and a generator are read twice (checks, then ZeroAdamW): both work
    params = (p for p in model.parameters())
    opt = zerokern.parallelize(model, stage=3, params=params, unit_classes=(Block,))
    assert len(opt.managed_params) == len(list(model.parameters()))


# -- item 5: stage is an int ------------------------------------------------------------------
@pytest.mark.parametrize("stage", [True, False, 2.0, 1.0, "2"])
def test_zeroadamw_refuses_a_stage_that_is_not_an_int(stage):
    model = OddNet()
    with pytest.raises(ValueError, match=f"stage must be 0, 1, 2 or 3, got {stage!r}"):
        zerokern.ZeroAdamW(model.parameters(), stage=stage)
    with pytest.raises(ValueError, match="stage must be"):
        ZeroConfig(stage=stage).validate()
    assert zerokern.ZeroAdamW(model.parameters(), stage=2).stage == 2


# -- item 11: parameters on the meta device ---------------------------------------------------
def _materialised(model: nn.Module) -> nn.Module:
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


def test_meta_parameters_are_refused_with_what_to_do():
    with torch.device("meta"):
        model = OddNet()
    with pytest.raises(ValueError, match=r"meta device.*model\.to_empty"):
        zerokern.ZeroAdamW(model.parameters(), stage=1)
    opt = zerokern.ZeroAdamW(_materialised(model).parameters(), stage=1)
    x, y = batch(0, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("call", ["shard_model", "parallelize"])
def test_meta_model_is_refused_before_sharding(call):
    with torch.device("meta"):
        model = TinyGPT()
    with pytest.raises(ValueError, match=r"meta device.*to_empty"):
        if call == "shard_model":
            zerokern.shard_model(model, unit_classes=(Block,))
        else:
            zerokern.parallelize(model, stage=3, unit_classes=(Block,))
    assert runtime_of_module(model) is None
    opt = zerokern.parallelize(_materialised(model), stage=3, unit_classes=(Block,))
    assert opt.stage == 3


# -- ZeroConfig -------------------------------------------------------------------------------
def test_config_is_what_the_keywords_build():
    model = OddNet().to(torch.bfloat16)
    cfg = ZeroConfig(stage=1, moments="int8", master="none", seed=7, bucket_numel=64)
    a = zerokern.ZeroAdamW(model.parameters(), config=cfg)
    b = zerokern.ZeroAdamW(model.parameters(), stage=1, moments="int8", master="none", seed=7,
                           bucket_numel=64)
    assert a.config == b.config == cfg
    assert (a.stage, a.seed, a.state_format.moments) == (1, 7, "int8")
    # an option given both ways is refused, naming it (config would override it silently)
    with pytest.raises(ValueError, match="seed=3 was given together with config="):
        zerokern.ZeroAdamW(model.parameters(), config=cfg, seed=3)
    # parallelize takes it too
    opt = zerokern.parallelize(model, params=model.parameters(), config=cfg)
    assert opt.config == cfg


def test_verdict_names_each_value_with_its_ranks():
    def facts(seed, moments):
        return {"where": "ZeroAdamW", "error": None, "mesh": None, "groups": None,
                "params": None, "options": {"seed": seed, "moments": moments}}

    gathered = [facts(0, "fp32"), facts(1, "fp32"), facts(1, "fp32"), facts(0, "int8")]
    assert verdict(gathered, "ZeroAdamW") == (
        "ZeroAdamW: options differ across ranks (every rank must give the same): seed is 0 "
        "on ranks 0, 3, 1 on ranks 1-2; moments is 'fp32' on ranks 0-2, 'int8' on rank 3")
    assert verdict([facts(0, "fp32")] * 4, "ZeroAdamW") is None
