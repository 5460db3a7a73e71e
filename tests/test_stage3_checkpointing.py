"""Activation checkpointing (torch.utils.checkpoint, both use_reentrant values) with ZeRO stage
3, wherever the regions lie relative to the units: a region that is one unit, one region over
several units, units finer than the region, a region over a layer outside any unit and units,
regions inside a unit, and regions nested in regions; with every parameter trained, with only
the last layer of each block trained (the unit's gradients are all in while the backward still
needs its frozen parameters: LayerNorm saves its weight as itself, a block's own gain is read
directly), and with LoRA-like adapters.

Against independent references: at world size 1 the reduced gradients are bitwise torch's own
for the same checkpointed model, step after step; at world sizes 1 and 2 the parameters
after training are those of the same sharded model without checkpointing (bitwise with
use_reentrant=False, where autograd does the same sums; within 1e-6 with the reentrant
backward, which sums the region's input gradients in another order) and, at world size 2, of
DDP-style averaging + torch AdamW; in bf16 as well. HF's ZeroTrainer with
gradient_checkpointing on Conv1D units logs the same grad norms as without it.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F
from _tol import TRAIN_FP32
from dist_utils import run_ranks
from test_zero_parity import _ref_average
from torch import nn
from torch.utils.checkpoint import checkpoint

import zerokern
from zerokern.zero.registry import runtime_of_module

DIM, HIDDEN, VOCAB, SEQ = 13, 27, 37, 5


class Lora(nn.Module):
    """A frozen linear layer plus a trained low-rank update (as PEFT's LoRA)."""

    def __init__(self, d: int, o: int) -> None:
        super().__init__()
        self.base = nn.Linear(d, o)
        self.a = nn.Linear(d, 2, bias=False)
        self.b = nn.Linear(2, o, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


class Block(nn.Module):
    """A transformer-like block with a parameter of its own (``gain``, read directly by its
    forward); ``inside`` checkpoints two regions within its forward."""

    def __init__(self, adapters: bool) -> None:
        super().__init__()
        lin = Lora if adapters else nn.Linear
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.up, self.down = lin(DIM, DIM), lin(DIM, HIDDEN), lin(HIDDEN, DIM)
        self.gain = nn.Parameter(torch.rand(DIM) + 0.5)
        self.inside: bool | None = None  # None: no region inside; else use_reentrant

    def _ck(self, fn, x: torch.Tensor) -> torch.Tensor:
        if self.inside is None:
            return fn(x)
        return checkpoint(fn, x, use_reentrant=self.inside)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self._ck(lambda z: self.attn(self.ln1(z)).softmax(-1) * z, h)
        return h + self._ck(lambda z: self.gain * self.down(F.gelu(self.up(self.ln2(z)))), h)


class Net(nn.Module):
    """emb -> pre -> 3 blocks -> head; ``mode`` says where the checkpoint regions are:
    none, each (one per block), over (one over blocks 0-1), span (one over pre and blocks
    0-1: a layer outside any unit), inside (two inside every block), nested (span + inside)."""

    def __init__(self, mode: str, reentrant: bool, adapters: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pre = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block(adapters) for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)
        self.mode, self.reentrant = mode, reentrant
        for b in self.blocks:
            b.inside = reentrant if mode in ("inside", "nested") else None

    def _ck(self, fn, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(fn, x, use_reentrant=self.reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.mode in ("span", "nested"):
            def region(h: torch.Tensor) -> torch.Tensor:
                h = self.pre(h)
                for b in self.blocks[:2]:
                    h = b(h)
                return h
            h = self._ck(region, h)
        else:
            h = self.pre(h)
            if self.mode == "over":
                h = self._ck(lambda h: self.blocks[1](self.blocks[0](h)), h)
            else:
                for b in self.blocks[:2]:
                    h = self._ck(b, h) if self.mode == "each" else b(h)
        last = self.blocks[2]
        h = self._ck(last, h) if self.mode == "each" else last(h)
        return self.head(h).mean(1)


# name: (where the regions are, unit classes)
PLACEMENTS = {
    "region_is_unit": ("each", (Block,)),
    "region_over_units": ("over", (Block,)),
    "units_finer_than_region": ("each", (nn.Linear,)),
    "layer_outside_units": ("span", (Block,)),
    "layer_outside_finer_units": ("span", (nn.Linear, nn.LayerNorm)),
    "region_inside_unit": ("inside", (Block,)),
    "nested_regions": ("nested", (Block,)),
}


def freeze(model: nn.Module, trained: str) -> None:
    """all: every parameter; late: in the blocks only ``down`` (the unit's gradients are all
    in before the backward reaches its frozen layers); adapters: the LoRA updates and the
    layers outside the blocks."""
    for name, p in model.named_parameters():
        if trained == "late" and name.startswith("blocks."):
            p.requires_grad_(name.split(".")[2] == "down")
        elif trained == "adapters" and name.startswith("blocks."):
            p.requires_grad_(".a." in name or ".b." in name)


def build(placement: str, reentrant: bool, trained: str, *, checkpointed: bool = True,
          dtype: torch.dtype = torch.float32) -> Net:
    mode, _ = PLACEMENTS[placement]
    torch.manual_seed(0)
    model = Net(mode if checkpointed else "none", reentrant, adapters=trained == "adapters")
    freeze(model, trained)
    return model.to(dtype)


def shard(model: Net, placement: str) -> tuple[Net, zerokern.ZeroAdamW]:
    _, units = PLACEMENTS[placement]
    model = zerokern.shard_model(model, unit_classes=units, prefetch=1)
    opt = zerokern.ZeroAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                             weight_decay=0.0, stage=3)
    return model, opt


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (4,), generator=g)


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return F.cross_entropy(model(x).float(), y)


def reduced_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """World size 1: every trained parameter's gradient, read from the unit slices."""
    rt = runtime_of_module(model)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for u in rt.units:
        flat = u.slice_of(rt.local_grads)
        for p, shape, off, n in zip(u.params, u.shapes, u.plan.param_offsets, u.plan.numels,
                                    strict=True):
            if p.requires_grad:
                out[names[id(p)]] = flat[off : off + n].view(shape)
    return out


def assert_clean(model: nn.Module) -> None:
    """After a backward: nothing gathered, every module holds its parameters again, no
    saved-tensor hooks left behind."""
    rt = runtime_of_module(model)
    assert not any(u.gathered or u.in_backward for u in rt.units)
    held = {id(p) for u in rt.units for p in u.params}
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and id(p) in held, name
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def assert_same(ours: dict, ref: dict, exact: bool, what: str) -> None:
    assert ours.keys() == ref.keys(), what
    for k in ref:
        assert torch.isfinite(ours[k]).all(), f"{what} {k}: not finite"
        if exact:
            assert torch.equal(ours[k], ref[k]), f"{what} {k}: {(ours[k] - ref[k]).abs().max()}"
        else:
            torch.testing.assert_close(ours[k], ref[k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k: f"{what} {k}: {m}")


def trained_params(model: nn.Module) -> dict[str, torch.Tensor]:
    full = zerokern.full_state_dict(model, rank0_only=False)
    return {n: full[n] for n, p in model.named_parameters() if p.requires_grad}


# -- world size 1: bitwise torch's gradients, step after step ---------------------------------
FOUR = ("region_is_unit", "units_finer_than_region", "layer_outside_units", "region_inside_unit")
CASES_1 = ([(p, t, "float32") for t in ("all", "late") for p in PLACEMENTS]
           + [(p, "adapters", "float32") for p in ("region_is_unit", "units_finer_than_region",
                                                  "region_inside_unit")]
           + [(p, "all", "bfloat16") for p in FOUR])


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # nested reentrant
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize(("placement", "trained", "dtype"), CASES_1)
def test_world1_gradients_are_torchs_for_the_same_checkpointing(placement, trained, dtype,
                                                                 reentrant):
    dtype = getattr(torch, dtype)
    ref = build(placement, reentrant, trained, dtype=dtype)
    ours, opt = shard(copy.deepcopy(ref), placement)
    plain, popt = shard(build(placement, reentrant, trained, checkpointed=False, dtype=dtype),
                        placement)
    for step in range(3):
        loss_of(ours, step, 0).backward()
        loss_of(ref, step, 0).backward()
        loss_of(plain, step, 0).backward()
        assert_clean(ours)
        want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        assert_same(reduced_grads(ours), want, True, f"step {step} gradients")
        opt.step()
        popt.step()
        opt.zero_grad()
        popt.zero_grad()
        ref.load_state_dict(zerokern.full_state_dict(ours))  # the next step starts alike
        ref.zero_grad()
    # The reentrant backward sums the region's input gradients in another order: in bf16 a
    # gradient near zero can then round to another value, and Adam's first steps move by lr
    # whatever the gradient's size. Its bf16 gradients were torch's own above.
    if dtype == torch.float32 or not reentrant:
        assert_same(trained_params(ours), trained_params(plain), not reentrant,
                    "against the model without checkpointing")


def test_world1_one_end_of_backward_per_backward():
    """The reentrant backward runs a backward of its own per region, nested in the outer one:
    the end of the backward (reduce what is left, release, the optimizer's callbacks) runs
    once, at the outer one's end, and a unit's recompute is not a forward of the step."""
    model, _ = shard(build("region_over_units", True, "all"), "region_over_units")
    rt = runtime_of_module(model)
    ends = []
    rt.backward_end_callbacks.append(lambda: ends.append(1))
    for step in range(2):
        loss_of(model, step, 0).backward()
        assert len(ends) == step + 1
        # Root, pre... the forward order holds each unit once: the recompute is not recorded.
        assert sorted(rt.order.current) == sorted(u.index for u in rt.units)


def test_world1_recompute_gathers_outside_the_arena():
    """A unit recomputed in the backward is gathered into a buffer of its own (the tensors the
    recompute saves keep their values however long they live), and the root stays gathered
    after its gradients are all in and reduced, until the backward ends."""
    model, _ = shard(build("region_is_unit", False, "all"), "region_is_unit")
    rt = runtime_of_module(model)
    root = next(u for u in rt.units if u.is_root)
    seen = []

    def watch(_p):  # after zerokern's own hook: block 0 and then the root reduced
        seen.append([(u.is_root, u.phase.name, u.block is None) for u in rt.units
                     if u.gathered])

    model.blocks[0].down.weight.register_post_accumulate_grad_hook(watch)
    model.emb.weight.register_post_accumulate_grad_hook(watch)  # the root's last gradient
    loss_of(model, 0, 0).backward()
    assert len(seen) == 2, seen
    assert (False, "BACKWARD", True) in seen[0], seen  # block 0, recomputed
    assert all(own for s in seen for root_, _, own in s if not root_), seen
    assert (True, "REDUCED", False) in seen[1], seen
    assert not root.gathered
    assert_clean(model)


# -- world size 2: against the model without checkpointing and against DDP + AdamW -----------
def _parity(rank: int, world: int, placement: str, reentrant: bool, dtype_name: str,
            trained: str) -> None:
    dtype = getattr(torch, dtype_name)
    base = build(placement, reentrant, trained, dtype=dtype)
    ours, opt = shard(copy.deepcopy(base), placement)
    plain, popt = shard(build(placement, reentrant, trained, checkpointed=False, dtype=dtype),
                        placement)
    ref = ropt = None
    if dtype == torch.float32:
        ref = copy.deepcopy(base)
        ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                 weight_decay=0.0, foreach=False)
    for step in range(3):
        for mb in range(2):  # the first micro-batch under no_sync
            for model, o in ((ours, opt), (plain, popt)):
                if mb == 0:
                    with o.no_sync():
                        (loss_of(model, 2 * step + mb, rank) / 2).backward()
                else:
                    (loss_of(model, 2 * step + mb, rank) / 2).backward()
                assert_clean(model)
            if ref is not None:
                (loss_of(ref, 2 * step + mb, rank) / 2).backward()
        for o in (opt, popt):
            o.step()
            o.zero_grad()
        got = trained_params(ours)
        assert_same(got, trained_params(plain), not reentrant, f"step {step} vs unchecked")
        if ref is not None:
            _ref_average(ref, world)
            ropt.step()
            ropt.zero_grad()
            for n, p in ref.named_parameters():
                if p.requires_grad:
                    torch.testing.assert_close(got[n], p.detach(), rtol=TRAIN_FP32[0],
                                               atol=TRAIN_FP32[1],
                                               msg=lambda m, n=n, s=step: f"step {s} {n}: {m}")


# bf16 with use_reentrant=False only: against the unchecked model bitwise (the reentrant
# backward's other summation order is torch's; its bf16 gradients are tested at world size 1).
CASES_2 = ([(p, "float32", "all", r) for p in PLACEMENTS for r in (False, True)]
           + [(p, "float32", "late", r) for p in ("layer_outside_units", "region_inside_unit")
              for r in (False, True)]
           + [(p, "bfloat16", "all", False) for p in FOUR])


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize(("placement", "dtype", "trained", "reentrant"), CASES_2)
def test_world2_matches_unchecked_and_ddp_adamw(placement, dtype, trained, reentrant, tmp_path):
    run_ranks(2, _parity, dict(placement=placement, reentrant=reentrant, dtype_name=dtype,
                               trained=trained), tmp_path=tmp_path, kwargs=True)


# -- HF ZeroTrainer: gradient_checkpointing on Conv1D units -----------------------------------
def _hf_checkpointing(rank: int, world: int, reentrant: bool, tmp: str) -> None:
    from integration_common import TokenData, as_launched, tiny_gpt2
    from transformers import TrainingArguments

    from zerokern.integrations.transformers import ZeroTrainer

    def train(ckpt: bool):
        kw = dict(gradient_checkpointing=True,
                  gradient_checkpointing_kwargs={"use_reentrant": reentrant}) if ckpt else {}
        args = TrainingArguments(
            output_dir=os.path.join(tmp, f"out{int(ckpt)}"), per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=4, learning_rate=3e-3, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
            optim="adamw_torch", dataloader_num_workers=0, **kw)
        model = tiny_gpt2()
        tr = ZeroTrainer(model=model, args=args, train_dataset=TokenData(), zero_stage=3,
                         unit_classes=["Conv1D"])
        tr.train()
        norms = [r["grad_norm"] for r in tr.state.log_history if "grad_norm" in r]
        full = zerokern.full_state_dict(model, rank0_only=False)
        return norms, {n: full[n] for n, _ in model.named_parameters()}

    def both() -> None:
        norms, params = train(True)
        ref_norms, ref_params = train(False)
        assert len(norms) == 4 and all(math.isfinite(n) for n in norms), norms
        for a, b in zip(norms, ref_norms, strict=True):
            assert math.isclose(a, b, rel_tol=1e-6), (norms, ref_norms)
        assert_same(params, ref_params, False, "ZeroTrainer with gradient_checkpointing")

    as_launched(lambda r, w: both())(rank, world)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_zero_trainer_gradient_checkpointing_on_conv1d_units(reentrant, tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    run_ranks(2, _hf_checkpointing, reentrant, str(tmp_path), tmp_path=tmp_path)
