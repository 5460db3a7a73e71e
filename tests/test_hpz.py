"""hpZ (ZeRO++'s hierarchical partitioning, issue 38): ``shard_model(hpz=True)`` on a (2, 2)
mesh of 4 gloo ranks.

One run_ranks call checks, on a small fp32 model of three units and a root holding a
parameter, over 3 steps:

- the parameters are bitwise those of the same model sharded over a flat group of all 4
  ranks (the primary partition is the flat one; the backward's in-node gathers deliver the
  bits the forward used; a share left over from before a step would break it), and within
  fp32 roundoff of torch.optim.AdamW on the all-reduced mean gradient (the independent
  reference) and of hybrid sharding (hpz=False, whose sums run in another order);
- with ``gather_dtype="int8"``, bitwise the flat quantized run (the secondary keeps the
  forward's decoding; the backward gathers it exactly);
- ``comm_stats()`` per dim equals ``formulas.hpz_comm_elements`` / ``hpz_comm_bytes``: the
  forward's gathers and the reduce-scatters over every rank (``"world"``), the backward's
  gathers in the node (``"shard"``), nothing across it;
- ``memory_stats()["hpz_secondary"]`` equals ``formulas.hpz_secondary_bytes`` and is in
  ``total``;
- the refusals: no 2-D mesh (on every rank, before anything changes), a ZeroAdamW given
  hpz=True for a model sharded without it.

Single-process: ZeroConfig's refusals (stage < 3, offload_params, not a bool).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import zerokern
from zerokern import ZeroConfig, formulas
from zerokern.zero.shard import runtime_of

_MESHES: dict[str, DeviceMesh] = {}
STEPS = 3


def _mesh() -> DeviceMesh:
    # One mesh per rank process (its subgroups live as long as the pool).
    if "2x2" not in _MESHES:
        _MESHES["2x2"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return _MESHES["2x2"]


class Net(nn.Module):
    """Three units of odd sizes and a root parameter (the root is gathered in the forward
    and again in the backward, as every unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(13, 17), nn.Linear(17, 11), nn.Linear(11, 13))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 13))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x * self.scale


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 13, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(dtype: torch.dtype = torch.float32, **kw) -> tuple[nn.Module, zerokern.ZeroAdamW]:
    torch.manual_seed(0)
    m = Net().to(dtype)
    opt = zerokern.parallelize(m, stage=3, unit_classes=(nn.Linear,), lr=1e-2, **kw)
    for step in range(STEPS):
        m(_data(step, dist.get_rank()).to(dtype)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _reference() -> dict[str, torch.Tensor]:
    """torch.optim.AdamW on the mean of every rank's gradient (all-reduced by hand)."""
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for step in range(STEPS):
        m(_data(step, dist.get_rank())).square().mean().backward()
        for p in m.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _params(m: nn.Module) -> dict[str, torch.Tensor]:
    return dict(zerokern.full_state_dict(m, rank0_only=False))


def _hpz_case(rank: int, world: int) -> None:
    mesh = _mesh()
    m, opt = _train(mesh=mesh, hpz=True)
    got = _params(m)
    flat_m, flat_opt = _train()
    flat = _params(flat_m)
    ref = _reference()
    hybrid = _params(_train(mesh=mesh)[0])  # hpz=False: the same mean, summed otherwise
    for k, v in got.items():
        assert torch.equal(v, flat[k]), f"{k}: hpZ differs from the flat group of 4 ranks"
        torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-6, msg=f"{k} vs torch AdamW")
        torch.testing.assert_close(v, hybrid[k], rtol=1e-5, atol=1e-6, msg=f"{k} vs hybrid")

    # Traffic of the last step, per dim, as the formulas say.
    psi = sum(u.plan.padded_numel for u in opt._rt.units)
    stats = opt.comm_stats()["per_dim"]
    assert set(stats) == {"world", "shard", "replicate"}
    want_e = formulas.hpz_comm_elements(psi, 2, 2)
    want_b = formulas.hpz_comm_bytes(psi, 2, 2, param_bytes=4)
    for dim in ("world", "shard", "replicate"):
        assert stats[dim]["elements"] == want_e[dim], (dim, stats[dim], want_e)
        assert stats[dim]["bytes"] == want_b[dim], (dim, stats[dim], want_b)
    assert set(stats["shard"]["per_kind"]) == {"all_gather"}  # only the backward's gathers
    assert stats["world"]["per_kind"]["all_gather"]["elements"] == psi  # the forward's

    # Memory: the secondary shares, 1/S of the units' padded space, counted in the total.
    mem = opt.memory_stats()
    assert mem["hpz_secondary"] == formulas.hpz_secondary_bytes(psi, 2, 2, param_bytes=4)
    assert mem["hpz_secondary"] == psi // 2 * 4
    flat_mem = flat_opt.memory_stats()
    assert flat_mem["hpz_secondary"] == 0
    assert mem["total"] - mem["hpz_secondary"] == flat_mem["total"]

    # int8 gathers: the secondary keeps the forward's decoding, the backward gathers it
    # exactly: bitwise the flat quantized run.
    q = _params(_train(torch.bfloat16, mesh=mesh, hpz=True, gather_dtype="int8")[0])
    qflat = _params(_train(torch.bfloat16, gather_dtype="int8")[0])
    for k, v in q.items():
        assert torch.equal(v, qflat[k]), f"{k}: hpZ with int8 gathers differs from flat"

    # Refusals, on every rank, before the model changes.
    plain = Net()
    with pytest.raises(ValueError, match="hpz=True needs a 2-D mesh"):
        zerokern.shard_model(plain, unit_classes=(nn.Linear,), hpz=True)
    assert runtime_of(plain) is None
    sharded = zerokern.shard_model(plain, unit_classes=(nn.Linear,), mesh=mesh)
    with pytest.raises(ValueError, match="the model was sharded without it"):
        zerokern.ZeroAdamW(sharded.parameters(), config=ZeroConfig(stage=3, hpz=True))


def test_hpz_on_a_2x2_mesh(tmp_path):
    run_ranks(4, _hpz_case, tmp_path=tmp_path)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(stage=2, hpz=True), ValueError, r"hpz=True at stage=2"),
    (dict(stage=3, hpz=True, offload="cpu", offload_params=True), ValueError,
     "hpz=True with offload_params=True is not built"),
    (dict(stage=3, hpz=1), TypeError, "hpz must be True or False"),
])
def test_hpz_refused_by_config(kw, exc, match):
    with pytest.raises(exc, match=match):
        ZeroConfig(**kw).validate()


def test_hpz_is_a_model_option_agreed_across_ranks():
    assert "hpz" in ZeroConfig.MODEL and "hpz" in ZeroConfig.AGREED
    assert ZeroConfig(stage=3, hpz=True).agreed()["hpz"] is True
