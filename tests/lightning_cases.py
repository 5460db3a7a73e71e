"""What the Lightning integration tests run on each rank (importable by spawned ranks).

A tiny random-init LightningModule (two residual blocks between two root layers, ~2k
parameters) trained on deterministic data for 20 optimizer steps with
accumulate_grad_batches=2 and a gradient_clip_val that fires at every step, an LR scheduler
stepping per optimizer step and a ModelCheckpoint that saves every 10 steps. The reference is
Lightning's own DDPStrategy with torch.optim.AdamW on the same data.

The batches are drawn from (rank, batch_idx), not from the DataLoader: resuming mid-epoch,
Lightning goes on counting batch_idx from the checkpoint but restarts a plain DataLoader
from its first batch (DDPStrategy too), so data read from the loader would differ after a
resume for reasons that have nothing to do with the strategy.
"""

from __future__ import annotations

import os
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from _tol import TRAIN_FP32
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zerokern
from zerokern.integrations.lightning import ZeroStrategy, to_lightning_checkpoint

DIM, HIDDEN, OUT = 8, 16, 4
BATCH, ACCUM, STEPS = 4, 2, 20
SAVE_AT = 10  # ModelCheckpoint(every_n_train_steps=...)
BATCHES = STEPS * ACCUM  # micro-batches per rank: one epoch
CLIP = 0.05  # below every step's gradient norm (asserted): clipping fires at every step
LR = 1e-2
VAL_BATCHES = 4
RTOL, ATOL = TRAIN_FP32

# Lightning's advice messages for this deliberately small setup.
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*Checkpoint directory.*exists and is not empty.*")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(self.ln(h))))


class Net(pl.LightningModule):
    """``zero_stage=None``: torch AdamW (for DDPStrategy); else ZeroAdamW of that stage."""

    def __init__(self, zero_stage: int | None, *, loss_scale: float | None = None,
                 manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, HIDDEN)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(HIDDEN, OUT)
        self.zero_stage = zero_stage
        self.loss_scale = loss_scale
        self.automatic_optimization = not manual
        self.losses: list[float] = []
        self.norms: list[float] = []  # each optimizer step's gradient norm before clipping
        # ZeroAdamW: gradient reductions (reduce-scatter / all-reduce calls) seen after the
        # micro-batches that accumulate (no_sync: none), and in each step (some).
        self.early_reductions = 0
        self.step_reductions: list[int] = []
        self.saved_weights: dict[str, torch.Tensor] | None = None  # seen at the last save

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = (t.to(self.dtype) for t in make_batch(self.global_rank, batch_idx))
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        # Manual optimization, the way Lightning documents it: all through self.optimizers().
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if self.zero_stage is None:
            self.norms.append(_grad_norm(self))
        else:
            self.norms.append(float(opt.clip_grad_norm_(CLIP)))  # on Lightning's wrapper
        if self.zero_stage is None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)
        opt.step()
        return None

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # DDP: the averaged gradients, before Lightning clips them.
        if self.automatic_optimization and self.zero_stage is None:
            self.norms.append(_grad_norm(self))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        opt = self.trainer.strategy.optimizers[0]
        if isinstance(opt, zerokern.ZeroOptimizer):  # its global norm, computed at the clip
            self.norms.append(opt.last_grad_norm)
            self.step_reductions.append(_reductions(opt.comm_stats()["per_kind"]))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        opt = self.trainer.strategy.optimizers[0]
        if isinstance(opt, zerokern.ZeroOptimizer) and self.automatic_optimization and \
                (batch_idx + 1) % ACCUM:  # a micro-batch that accumulates
            self.early_reductions += _reductions(opt.comm.stats.as_dict())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # What this hook (and a callback) sees of the weights: DDP gives the module's.
        self.saved_weights = {k: v.detach().clone() for k, v in checkpoint["state_dict"].items()}

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        other = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
        if self.zero_stage is None:
            opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=LR, foreach=False)
        else:
            opt = zerokern.ZeroAdamW(groups, lr=LR, stage=self.zero_stage,
                                     loss_scale=self.loss_scale)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _reductions(per_kind: dict[str, dict[str, int]]) -> int:
    return sum(per_kind.get(k, {}).get("calls", 0) for k in ("reduce_scatter", "all_reduce"))


def _grad_norm(model: nn.Module) -> float:
    grads = [p.grad.detach().reshape(-1) for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat(grads)))


def make_batch(rank: int, batch_idx: int, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed((salt * 10_000 + batch_idx) * 64 + rank)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, OUT, generator=g)


def _loader(world: int) -> DataLoader:
    # Only its length matters (one epoch of BATCHES per rank, after Lightning's
    # DistributedSampler): the batches come from make_batch.
    return DataLoader(TensorDataset(torch.arange(world * BATCHES * BATCH)), batch_size=BATCH)


def _env(rank: int, world: int) -> None:
    # The process group exists already (a file rendezvous): Lightning uses it as it is and
    # needs these only to know its rank and that it must not launch processes itself.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")


def _trainer(rank: int, world: int, strategy: Any, ckpt_dir: Path | None, *,
             max_steps: int = STEPS, manual: bool = False, ckpt_every: int = SAVE_AT,
             top_k: int = -1, **kwargs: Any) -> pl.Trainer:
    _env(rank, world)
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{step}",
                                         every_n_train_steps=ckpt_every, save_top_k=top_k))
    opts: dict[str, Any] = dict(accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
    if manual:
        opts = {}
    return pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, max_steps=max_steps,
        callbacks=callbacks, enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False, logger=False, enable_model_summary=False,
        num_sanity_val_steps=0, **opts, **kwargs)


def _ddp() -> DDPStrategy:
    return DDPStrategy(process_group_backend="gloo")


def _params(trainer: pl.Trainer, model: pl.LightningModule) -> dict[str, torch.Tensor]:
    if isinstance(trainer.strategy, ZeroStrategy):
        return trainer.strategy.full_state_dict(rank0_only=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: (
            f"{what}: {k}: {m}"))


def _close_list(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} values vs {len(b)}"
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64),
                               torch.tensor(b, dtype=torch.float64), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")


def _ckpt(d: Path, step: int) -> Path:
    return d / f"step={step}.ckpt"


_REFERENCE: dict[str, Any] = {}


def reference(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """DDPStrategy + torch AdamW: losses, pre-clip norms, step-20 parameters, and its
    step-10 checkpoint (a file). Run once per job."""
    if _REFERENCE.get("tmp") == tmp:
        return _REFERENCE
    model = Net(None)
    trainer = _trainer(rank, world, _ddp(), tmp / "ddp")
    trainer.fit(model, _loader(world))
    assert trainer.global_step == STEPS
    assert len(model.norms) == STEPS and min(model.norms) > CLIP, model.norms
    _REFERENCE.update(tmp=tmp, losses=model.losses, norms=model.norms,
                      params=_params(trainer, model), ckpt10=_ckpt(tmp / "ddp", SAVE_AT),
                      saved=model.saved_weights)
    return _REFERENCE


def parity_and_resume(rank: int, world: int, *, stage: int, tmp: str) -> None:
    """ZeroStrategy(stage) against DDPStrategy: losses, clipping norms and step-20
    parameters; resume in a fresh Trainer from its own step-10 checkpoint (a zerokern
    directory written by ModelCheckpoint) and from DDP's (a file)."""
    base = Path(tmp)
    ref = reference(rank, world, base)
    units = (Block,) if stage == 3 else None
    ckdir = base / f"zero{stage}"

    model = Net(stage)
    trainer = _trainer(rank, world, ZeroStrategy(stage=stage, unit_classes=units), ckdir)
    trainer.fit(model, _loader(world))
    assert trainer.global_step == STEPS
    assert not any(isinstance(m, nn.parallel.DistributedDataParallel)
                   for m in (trainer.strategy.model, trainer.model))
    assert len(model.norms) == STEPS and min(model.norms) > CLIP, model.norms  # clip fired
    assert model.early_reductions == 0, "accumulation micro-batches communicated"
    assert len(model.step_reductions) == STEPS and min(model.step_reductions) > 0
    _close_list(model.norms, ref["norms"], f"stage {stage}: pre-clip gradient norms")
    _close_list(model.losses, ref["losses"], f"stage {stage}: losses")
    final = _params(trainer, model)
    _close(final, ref["params"], f"stage {stage}: step-{STEPS} parameters vs DDP")
    # checkpoint["state_dict"] in on_save_checkpoint at the last save: the weights, as with
    # DDP (stage 3: gathered on rank 0, as FSDPStrategy's full state dict).
    if stage == 3 and rank != 0:
        assert model.saved_weights == {}, sorted(model.saved_weights or {})
    else:
        _close(model.saved_weights or {}, ref["saved"],
               f"stage {stage}: checkpoint['state_dict'] seen by on_save_checkpoint")

    ck10 = _ckpt(ckdir, SAVE_AT)
    assert ck10.is_dir() and (ck10 / "meta.json").is_file(), ck10
    assert ref["ckpt10"].is_file(), ref["ckpt10"]
    half = SAVE_AT * ACCUM
    for source, what in ((ck10, "own step-10 checkpoint"), (ref["ckpt10"], "DDP's checkpoint")):
        resumed = Net(stage)
        tr = _trainer(rank, world, ZeroStrategy(stage=stage, unit_classes=units), None)
        tr.fit(resumed, _loader(world), ckpt_path=str(source))
        assert tr.global_step == STEPS, (what, tr.global_step)
        # The scheduler went on from where it was: lr after 20 steps of StepLR(7, 0.5).
        assert tr.optimizers[0].param_groups[0]["lr"] == LR * 0.5 ** (STEPS // 7), what
        _close_list(resumed.losses, ref["losses"][half:], f"stage {stage}: losses after {what}")
        _close_list(resumed.norms, ref["norms"][SAVE_AT:],
                    f"stage {stage}: norms after {what}")
        _close(_params(tr, resumed), ref["params"],
               f"stage {stage}: step-{STEPS} parameters after resuming from {what}")
        if source is ck10:
            _close(_params(tr, resumed), final, f"stage {stage}: resumed vs uninterrupted")


def _raises(fn: Any, exc: type[BaseException], text: str) -> None:
    try:
        fn()
    except exc as e:
        assert text in str(e), f"expected {text!r} in: {e}"
        return
    raise AssertionError(f"expected {exc.__name__} ({text!r})")


class _TorchAdamWNet(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR)


class _SGDNet(Net):
    """torch SGD with momentum (DDPStrategy) or strategy.zero_optimizer of it (ZeroStrategy)."""

    def configure_optimizers(self) -> Any:
        hp = dict(lr=LR, momentum=0.9, weight_decay=0.01)
        if self.zero_stage is None:
            return torch.optim.SGD(self.parameters(), foreach=False, **hp)
        return self.trainer.strategy.zero_optimizer(self.parameters(), torch.optim.SGD, **hp)


def habits(rank: int, world: int, *, tmp: str) -> None:
    """What a Lightning user may also do, against DDPStrategy where there is a reference:
    manual optimization through self.optimizers() (zero_grad, manual_backward,
    clip_grad_norm_ on Lightning's wrapper, step), ZeroAdamW's own loss scaler, evaluation
    from a checkpoint directory, and the refusals."""
    base = Path(tmp)
    steps = 6

    # Manual optimization: stage 2 against DDP + torch AdamW + torch's clip_grad_norm_.
    runs = {}
    for stage in (None, 2):
        model = Net(stage, manual=True)
        strategy = _ddp() if stage is None else ZeroStrategy(stage=stage)
        tr = _trainer(rank, world, strategy, None, max_steps=steps, manual=True)
        tr.fit(model, _loader(world))
        runs[stage] = (model.losses, model.norms, _params(tr, model))
    assert min(runs[None][1]) > CLIP
    _close_list(runs[2][0], runs[None][0], "manual optimization: losses")
    _close_list(runs[2][1], runs[None][1], "manual optimization: clip_grad_norm_ norms")
    _close(runs[2][2], runs[None][2], "manual optimization: parameters")

    # Another torch class: strategy.zero_optimizer(params, torch.optim.SGD, momentum) at
    # stage 2 against DDPStrategy + torch SGD, with accumulation and clipping that fires.
    runs = {}
    for stage in (None, 2):
        model = _SGDNet(stage)
        strategy = _ddp() if stage is None else ZeroStrategy(stage=stage)
        tr = _trainer(rank, world, strategy, None, max_steps=steps)
        tr.fit(model, _loader(world))
        if stage is not None:
            assert type(tr.strategy.optimizers[0]) is zerokern.ZeroOptimizer
        runs[stage] = (model.losses, model.norms, _params(tr, model))
    assert len(runs[None][1]) == steps and min(runs[None][1]) > CLIP
    _close_list(runs[2][0], runs[None][0], "ZeroOptimizer(SGD): losses")
    _close_list(runs[2][1], runs[None][1], "ZeroOptimizer(SGD): clipping norms")
    _close(runs[2][2], runs[None][2], "ZeroOptimizer(SGD): parameters")

    # ZeroAdamW(loss_scale=...): the strategy scales the loss, step() unscales (a power of
    # two: exact in fp32, so it matches the unscaled DDP run).
    # Its ModelCheckpoint keeps the latest only: the older directories are deleted.
    model = Net(1, loss_scale=1024.0)
    tr = _trainer(rank, world, ZeroStrategy(stage=1), base / "top1", max_steps=steps,
                  ckpt_every=2, top_k=1)
    tr.fit(model, _loader(world))
    tr.strategy.barrier()
    kept = sorted(p.name for p in (base / "top1").iterdir() if not p.name.endswith(".lock"))
    assert kept == [f"step={steps}.ckpt"], kept
    ddp_model = Net(None)
    tr_ddp = _trainer(rank, world, _ddp(), None, max_steps=steps)
    tr_ddp.fit(ddp_model, _loader(world))
    _close_list(model.norms, ddp_model.norms, "loss_scale: norms")
    _close(_params(tr, model), _params(tr_ddp, ddp_model), "loss_scale: parameters")

    # Evaluation from a checkpoint directory (validate has no optimizer): stage 3 reads the
    # stage-1 checkpoint of the run above and evaluates with its weights.
    ck = base / "eval.ckpt"
    tr.save_checkpoint(ck)  # after the fit: the step-6 state
    ev = _ValNet(None)
    _trainer(rank, world, ZeroStrategy(stage=3, unit_classes=(Block,)), None,
             limit_val_batches=VAL_BATCHES).validate(ev, _loader(world), ckpt_path=str(ck))
    assert sorted(ev.seen) == list(range(VAL_BATCHES)), ev.seen
    _close_list([ev.seen[b] for b in range(VAL_BATCHES)],
                _val_losses(_params(tr, model), rank, VAL_BATCHES),
                "validate(ckpt_path=...) losses")

    # 16-bit parameters (ZeroAdamW keeps their fp32 master), at stage 3: a smoke run.
    model = Net(3)
    tr = _trainer(rank, world, ZeroStrategy(stage=3, unit_classes=(Block,)), None,
                  max_steps=4, precision="bf16-true")
    tr.fit(model, _loader(world))
    weights = tr.strategy.full_state_dict(rank0_only=False)
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert len(model.norms) == 4 and all(n == n and n > CLIP for n in model.norms), model.norms

    # Refusals, before anything is trained.
    _raises(lambda: _trainer(rank, world, ZeroStrategy(stage=2), None).fit(
        _TorchAdamWNet(2), _loader(world)), TypeError, "must return zerokern.ZeroAdamW")
    _raises(lambda: _trainer(rank, world, ZeroStrategy(stage=1), None).fit(
        Net(2), _loader(world)), ValueError, "give both the same stage")
    _raises(lambda: _trainer(rank, world, ZeroStrategy(stage=2), None,
                             gradient_clip_algorithm="value").fit(Net(2), _loader(world)),
            ValueError, "gradient_clip_algorithm='value' is not supported")
    # Lightning's own DDPStrategy with a ZeroAdamW: DDP wraps the model before
    # configure_optimizers builds ZeroAdamW, so building it refuses the model and names
    # ZeroStrategy; no step has run.
    plain = Net(2)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    _raises(lambda: _trainer(rank, world, _ddp(), None).fit(plain, _loader(world)),
            RuntimeError, "ZeroStrategy")
    assert all(torch.equal(v, before[k]) for k, v in plain.state_dict().items())


class _ValNet(Net):
    """Records each validation batch's loss, by batch index."""

    def __init__(self, zero_stage: int | None) -> None:
        super().__init__(zero_stage)
        self.seen: dict[int, float] = {}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = make_batch(self.global_rank, batch_idx, salt=1)
        self.seen[batch_idx] = F.mse_loss(self(x), y).item()


def _val_losses(params: dict[str, torch.Tensor], rank: int, batches: int) -> list[float]:
    """This rank's validation losses, computed directly with ``params``."""
    model = Net(None)
    model.load_state_dict(params)
    with torch.no_grad():
        return [F.mse_loss(model(x), y).item()
                for x, y in (make_batch(rank, b, salt=1) for b in range(batches))]


def eval_after_fit(rank: int, world: int, *, tmp: str) -> None:
    """validate(ckpt_path=...) on the Trainer that has just fit (the autoencoder example's
    test(ckpt_path="best")): the fit's ZeroAdamW still trains the weights, so they load through
    it; the losses are those of the checkpoint's weights read into a plain model."""
    base = Path(tmp) / "after_fit"
    model = _ValNet(3)
    tr = _trainer(rank, world, ZeroStrategy(stage=3, unit_classes=(Block,)), base,
                  max_steps=4, ckpt_every=2, limit_val_batches=VAL_BATCHES)
    tr.fit(model, _loader(world))
    ck2 = _ckpt(base, 2)
    plain = Net(None)
    zerokern.load_checkpoint(str(ck2), plain, None)  # this process alone: a plain model
    tr.validate(model, _loader(world), ckpt_path=str(ck2))
    _close_list([model.seen[b] for b in range(VAL_BATCHES)],
                _val_losses(plain.state_dict(), rank, VAL_BATCHES),
                "validate(ckpt_path=step 2) after fit")
    _close(tr.strategy.full_state_dict(rank0_only=False), plain.state_dict(),
           "the weights after validate(ckpt_path=step 2)")
    # LightningModule.load_from_checkpoint reads one file: the directory converted to one.
    one = base / f"step2.rank{rank}.ckpt"
    to_lightning_checkpoint(ck2, one)
    loaded = Net.load_from_checkpoint(one, zero_stage=None)
    assert loaded.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert torch.load(one, weights_only=False)["global_step"] == 2


def refit(rank: int, world: int, *, tmp: str) -> None:
    """A second fit of the same LightningModule in a new Trainer (the first one still alive,
    as in a notebook): its configure_optimizers builds a new ZeroAdamW over the parameters
    the first fit's still trains, which takes them over. Stage 2 against DDPStrategy doing
    the same (a fresh torch AdamW)."""
    runs = {}
    for stage in (None, 2):
        model = Net(stage)
        trainers = []
        for _ in range(2):
            strategy = _ddp() if stage is None else ZeroStrategy(stage=stage)
            trainers.append(_trainer(rank, world, strategy, None, max_steps=3))
            trainers[-1].fit(model, _loader(world))
        runs[stage] = (model.losses, _params(trainers[-1], model))
    _close_list(runs[2][0], runs[None][0], "second fit: losses")
    _close(runs[2][1], runs[None][1], "second fit: parameters")


def constructor(rank: int, world: int, *, tmp: str) -> None:
    """Arguments refused when the strategy is built, before any Trainer exists."""
    from pytorch_lightning.plugins.precision import MixedPrecision

    _raises(lambda: ZeroStrategy(stage=4), ValueError, "stage must be 0, 1, 2 or 3")
    # zerokern's options: one ZeroConfig, or its fields as keywords, checked at once.
    _raises(lambda: ZeroStrategy(stage=3, moments="int4"), ValueError, "moments must be one of")
    _raises(lambda: ZeroStrategy(moment="int8"), TypeError, "unexpected keyword 'moment'")
    _raises(lambda: ZeroStrategy(config=zerokern.ZeroConfig(stage=3), moments="int8"),
            ValueError, "moments='int8' was given together with config=")
    _raises(lambda: ZeroStrategy(mesh="2x2"), TypeError, "mesh must be a")
    _raises(lambda: ZeroStrategy(stage=2, offload_params=True), ValueError,
            "offload_params=True: parameter shards in host memory are stage 3's")
    assert ZeroStrategy(stage=1, moments="int8", reduce_dtype=torch.float32).config == \
        ZeroStrategy(config=zerokern.ZeroConfig(stage=1, moments="int8",
                                                reduce_dtype=torch.float32)).config
    # The stage-3 options are ignored at stages 0-2, as by zerokern.parallelize.
    assert ZeroStrategy(stage=2, unit_classes=[Block]).config.unit_classes == (Block,)
    _raises(lambda: ZeroStrategy(stage=2, precision_plugin=MixedPrecision("16-mixed", "cpu")),
            ValueError, "GradScaler")
    assert ZeroStrategy(stage=1).stage == 1


CASES = {
    "constructor": constructor,
    "stage1": lambda rank, world, tmp: parity_and_resume(rank, world, stage=1, tmp=tmp),
    "stage2": lambda rank, world, tmp: parity_and_resume(rank, world, stage=2, tmp=tmp),
    "stage3": lambda rank, world, tmp: parity_and_resume(rank, world, stage=3, tmp=tmp),
    "habits": habits,
    "eval_after_fit": eval_after_fit,
    "refit": refit,
}


def run_cases(rank: int, world: int, *, tmp: str, results: str) -> None:
    """Every case in CASES, in one job (importing Lightning costs more than all the cases
    together). Each case leaves ``<results>/<case>.rank<r>.ok`` or ``.err`` (its traceback);
    the first failure ends the job, since the ranks may then be at different collectives."""
    torch.set_num_threads(1)
    out = Path(results)
    for name, case in CASES.items():
        try:
            case(rank, world, tmp=tmp)
        except BaseException:
            (out / f"{name}.rank{rank}.err").write_text(traceback.format_exc())
            raise
        (out / f"{name}.rank{rank}.ok").write_text("")
