"""memory_stats() of a compressed optimizer state (issue 27: ``ZeroAdamW(moments=, master=)``).

Each kind is checked against bytes computed here from the parameters' sizes and the format's
rules alone (bytes per element of each buffer, one fp32 absmax per 256-element block,
parameters under 4,096 elements keeping fp32 moments in side buffers), never from the engine's
specs or layout code: every format (fp32 / bf16 / int8 moments x fp32 / no master), stages 0-3,
offload on and off, at world size 1; the numbers reported before the first step of stages 0-2
equal those after it; the measured K of each format (optimizer-state bytes per parameter)
equals the table of docs/compressed-state.md and zerokern.formulas; and at world sizes 2 and 3
(torch's fake process group, tests/fake_pg.py: only sizes are asserted) the ranks' moments add
up to the whole model's, each rank's int8 blocks whole.

The steps run the pure-PyTorch backend (the bytes do not depend on the backend, and the native
compressed kernels need not be built for this file).
"""

from __future__ import annotations

import gc

import pytest
import torch
from fake_pg import each_rank
from torch import nn

import zerokern
from zerokern import formulas

MOMENTS = ("fp32", "bf16", "int8")
MASTERS = ("fp32", "none")
MOMENT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}  # per element, as the format stores it
SMALL = 4096  # parameters with fewer elements keep fp32 moments
BLOCK = 256  # elements per int8 block, one fp32 absmax each
OPT_KINDS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax",
             "exp_avg_side", "exp_avg_sq_side")

# The measured K of each format for parameters of at least 4,096 elements, on the device and
# (offload="cpu") on the host, written out by hand: bytes of master + exp_avg + exp_avg_sq
# (+ 2 x 4 bytes per 256 elements of absmax for int8).
K_DEVICE = {("fp32", "fp32"): 12, ("bf16", "fp32"): 8, ("int8", "fp32"): 6 + 8 / 256,
            ("fp32", "none"): 8, ("bf16", "none"): 4, ("int8", "none"): 2 + 8 / 256}
K_HOST = {**K_DEVICE, ("fp32", "none"): 10, ("bf16", "none"): 6, ("int8", "none"): 4 + 8 / 256}


class Aligned(nn.Module):
    """Every parameter a multiple of 256 elements, so a world-size-1 layout has no padding
    whatever the order: three large ones (>= 4096) and, with ``norm``, two small ones."""

    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 256)  # 10240
        self.norm = nn.LayerNorm(256) if norm else nn.Identity()  # 256 + 256
        self.fc1 = nn.Linear(256, 32, bias=False)  # 8192
        self.fc2 = nn.Linear(32, 160, bias=False)  # 5120

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.norm(self.emb(x)))))


class Odd(nn.Module):
    """Odd sizes: large parameters that do not fill their last block, small ones between
    them, and a frozen one (stage 3 keeps its slice; no state is trained for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 130)  # 4810
        self.fc1 = nn.Linear(130, 33)  # 4290 + 33
        self.norm = nn.LayerNorm(33)  # 33 + 33
        self.fc2 = nn.Linear(33, 7)  # 231 + 7
        self.big = nn.Linear(7, 700, bias=False)  # 4900
        self.frozen = nn.Parameter(torch.randn(300), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc1(self.emb(x))) + self.frozen[:1]
        return self.big(self.fc2(h))


def _build(model_cls, stage, moments, master, dtype, offload, offload_params=False, **kw):
    torch.manual_seed(0)
    model = model_cls(**kw).to(dtype)
    if stage == 3:
        model = zerokern.shard_model(model, offload_params=offload_params)
    opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, moments=moments, master=master,
                             offload=offload, backend="torch")
    return model, opt


def _step(model, opt, step=0, rank=0):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, 37, (3, 4), generator=g)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def _sizes(model):
    trained = [p.numel() for p in model.parameters() if p.requires_grad]
    psi = sum(trained)
    small = sum(n for n in trained if n < SMALL)
    return psi, small


def _expected(psi, small, blocks, moments, master, dtype, offload, params_on_host=False):
    """The optimizer state's bytes by kind, from the format's rules: ``psi`` trained elements
    of which ``small`` in parameters under 4,096 elements, ``blocks`` 256-element blocks."""
    on_host = offload is not None
    copy = on_host and not params_on_host  # the offloaded step updates a copy of the values
    if master == "none":
        mbytes = 2 if copy else 0  # the bf16 copy of the parameters
    else:
        mbytes = 4 if dtype == torch.bfloat16 or copy else 0  # fp32 params: their own master
    e = MOMENT_BYTES[moments]
    side = 4 * small if moments != "fp32" else 0
    absmax = 4 * blocks if moments == "int8" else 0
    kinds = {"master": mbytes * psi, "exp_avg": e * psi, "exp_avg_sq": e * psi,
             "exp_avg_absmax": absmax, "exp_avg_sq_absmax": absmax,
             "exp_avg_side": side, "exp_avg_sq_side": side}
    zeros = dict.fromkeys(OPT_KINDS, 0)
    if on_host:
        return {**zeros, **{f"host_{k}": v for k, v in kinds.items()}}
    return kinds


def _cases():
    # bf16 parameters: every format at every stage and placement. fp32 parameters (their own
    # master; master="none" refused): the placements whose master differs, at stages 2-3.
    for dtype in (torch.bfloat16, torch.float32):
        for moments in MOMENTS:
            for master in MASTERS:
                if master == "none" and dtype != torch.bfloat16:
                    continue  # refused: master="none" needs bf16 parameters
                for stage in (0, 1, 2, 3):
                    for offload in ((None,) if stage == 0 else (None, "cpu")):
                        if dtype == torch.float32 and (stage < 2 or (stage, offload) == (
                                3, "cpu")):
                            continue
                        yield pytest.param(
                            stage, moments, master, dtype, offload,
                            id=f"s{stage}-{moments}-{master}-{str(dtype)[6:]}"
                               f"{'-offload' if offload else ''}")


@pytest.mark.parametrize("stage,moments,master,dtype,offload", list(_cases()))
def test_memory_stats_by_kind_at_world_size_one(stage, moments, master, dtype, offload):
    model, opt = _build(Aligned, stage, moments, master, dtype, offload)
    psi, small = _sizes(model if stage < 3 else Aligned())
    assert (psi, small) == (24064, 512)
    before = opt.memory_stats()
    _step(model, opt)
    ms = opt.memory_stats()
    want = _expected(psi, small, psi // BLOCK, moments, master, dtype, offload)
    got = {k: ms[k] for k in want}
    assert got == want
    # Every size is a multiple of 256: nothing is padded at world size 1.
    assert ms["padding"] == 0 and ms.get("host_padding", 0) == 0
    if stage < 3:  # laid out at the first step: what was reported before is what it holds
        assert before == ms
    # The state's bytes are in the arena that holds them (blocks rounded up to 256 bytes;
    # stage 3 on the device: its total is the runtime's slices and the engine's arena).
    side = "host_" if offload else ""
    state = sum(ms[f"{side}{k}"] for k in OPT_KINDS) + ms[f"{side}padding"]
    arena = ms.get(f"{side}arena_in_use", ms["total"])
    held = state + (0 if offload else ms["params"] + ms["grads"] + ms["buckets"])
    if offload:
        held += ms["host_grads"] + ms["host_staging"] + ms["host_params"]
    assert held <= arena <= held + 16 * 256
    del model, opt
    gc.collect()


@pytest.mark.parametrize("moments,master", [(m, ma) for m in MOMENTS for ma in MASTERS])
@pytest.mark.parametrize("stage,offload", [(0, None), (2, None), (3, None), (2, "cpu"),
                                           (3, "cpu")])
def test_measured_k_is_the_format_k(stage, offload, moments, master):
    # Large parameters only: the optimizer state per parameter is the format's K exactly.
    # No step: stage 3 holds its state from construction on, and stages 0-2 report before
    # their first step what they allocate at it (test_memory_stats_by_kind_at_world_size_one).
    model, opt = _build(Aligned, stage, moments, master, torch.bfloat16, offload, norm=False)
    ms = opt.memory_stats()
    psi = 10240 + 8192 + 5120
    side = "host_" if offload else ""
    k = sum(ms[f"{side}{kind}"] for kind in OPT_KINDS) / psi
    assert k == (K_HOST if offload else K_DEVICE)[moments, master]
    assert k == formulas.optimizer_bytes_per_param(2, moments, master, on_host=bool(offload))
    if offload is None:  # the paper's stage formula with this K, at Ψ = psi (no padding)
        total = ms["params"] + ms["grads"] + sum(ms[kind] for kind in OPT_KINDS)
        assert total == formulas.expected_model_state_bytes(stage, psi, 1, 2, moments, master)


@pytest.mark.parametrize("moments,master", [("int8", "fp32"), ("int8", "none"),
                                            ("bf16", "none")])
def test_stage3_offload_params_keeps_no_copy(moments, master):
    # The parameter shard lives in host memory: master="none" updates it there in place.
    model, opt = _build(Aligned, 3, moments, master, torch.bfloat16, "cpu",
                        offload_params=True)
    _step(model, opt)
    ms = opt.memory_stats()
    want = _expected(24064, 512, 24064 // BLOCK, moments, master, torch.bfloat16, "cpu",
                     params_on_host=True)
    assert {k: ms[k] for k in want} == want
    assert ms["host_params"] == 2 * 24064 and ms["total"] == 0


def _ranks_case(rank, world, stage, moments, master, offload):
    model, opt = _build(Odd, stage, moments, master, torch.bfloat16, offload)
    before = opt.memory_stats() if stage < 3 else None
    _step(model, opt, 0, rank)
    ms = opt.memory_stats()
    if before is not None:
        for k in (*OPT_KINDS, "padding", "params", "grads"):
            assert before[k] == ms[k], k
        for k in OPT_KINDS:
            assert before.get(f"host_{k}") == ms.get(f"host_{k}"), k
    L = opt.layout
    if moments == "int8":  # shards are cut on blocks: this rank's blocks are whole
        assert L.local_numel % BLOCK == 0
    side = "host_" if offload else ""
    blocks = L.local_numel // BLOCK if moments == "int8" else 0
    assert ms[f"{side}exp_avg_absmax"] == ms[f"{side}exp_avg_sq_absmax"] == 4 * blocks
    return {k: ms[f"{side}{k}"] for k in OPT_KINDS}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage,offload", [(2, None), (3, None), (2, "cpu")])
@pytest.mark.parametrize("moments,master", [("int8", "fp32"), ("int8", "none"),
                                            ("bf16", "fp32")])
def test_ranks_together_hold_the_whole_state(world, stage, offload, moments, master):
    ranks = each_rank(world, lambda r, w: _ranks_case(r, w, stage, moments, master, offload))
    psi, small = _sizes(Odd())
    assert (psi, small) == (14337, 337)
    e = MOMENT_BYTES[moments]
    total = {k: sum(r[k] for r in ranks) for k in OPT_KINDS}
    # Each trained element has one owner: the moments' slots and the fp32 side moments add up
    # to the model's, whatever the world size (small parameters stay fp32 on every shard).
    assert total["exp_avg"] == total["exp_avg_sq"] == e * psi
    assert total["exp_avg_side"] == total["exp_avg_sq_side"] == (4 * small if e < 4 else 0)
    copy = 2 if offload else 0
    assert total["master"] == (4 if master == "fp32" else copy) * psi


def test_fp32_params_with_master_none_are_refused_before_anything_is_built():
    model = Aligned()
    with pytest.raises(ValueError, match="master='none' needs bf16"):
        zerokern.ZeroAdamW(model.parameters(), stage=2, moments="int8", master="none")
