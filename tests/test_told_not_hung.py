"""Told, not hung (issue 24, part 4): habits of DDP + AdamW scripts that used to hang or break
far from their cause either work as with DDP + torch AdamW or raise an error that names what
happened and what to do.

1. Stage 3, evaluation on rank 0 only: the rank that waits in a gather the others never start
   raises CollectiveTimeout within ``gather_timeout`` (not the process group's 30 minutes);
   a rank that is merely slow does not trip it; the processes exit. Likewise (stages 1-3)
   the optimizer's full_state_dict() run by rank 0 alone (nanoGPT's checkpoint), and
   zerokern.save_checkpoint / load_checkpoint run by rank 0 alone.
2. `p.data = t` after the first step trains t, as with DDP + AdamW (stages 0-3, the fp32
   master of 16-bit parameters included); `model.to(torch.bfloat16)` after it is refused
   with an error naming the cast, before anything is updated.
3. torch.compile: no "global hooks on modules" warning (zerokern registers no global module
   hook; a model wrapped in DDP before ZeroAdamW / shard_model is refused when they are
   built), and the compiled model trains as DDP + AdamW.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from _tol import TRAIN_FP32
from dist_utils import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zerokern
from zerokern.comm import CollectiveTimeout
from zerokern.zero import gather_timeout as told

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) + x


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 3))


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1],
                               msg=lambda m: f"{what}: {m}")


def _one_step(model: torch.nn.Module, opt: zerokern.ZeroAdamW,
              rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step on this rank's first batch, which it returns."""
    x, y = _data(0, rank)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return x, y


# -- 1. stage 3: a gather the other ranks never start ----------------------------------------

def rank0_eval_case(rank: int, world: int, timeout: float) -> None:
    torch.manual_seed(0)
    model = zerokern.shard_model(_net(), unit_classes=(Block,), gather_timeout=timeout)
    opt = zerokern.ZeroAdamW(model.parameters(), stage=3, **HP)
    x, y = _one_step(model, opt, rank)
    if rank != 0:
        return  # nanoGPT: only the master process evaluates
    model.eval()
    start = time.monotonic()
    with torch.no_grad(), pytest.raises(CollectiveTimeout) as info:
        model(x)
    waited = time.monotonic() - start
    # Told after the limit, not after the process group's 30 minutes.
    assert timeout * 0.95 <= waited < timeout + 30, waited
    msg = str(info.value)
    for part in (f"rank 0 of {world} waited", "all-gather of the parameters of unit '<root>'",
                 "`if rank == 0:`", "zerokern.load_checkpoint(path, plain_model, None)",
                 "gather_timeout=SECONDS", "ZEROKERN_GATHER_TIMEOUT", "end the process"):
        assert part in msg, (part, msg)
    # The runtime does not go on (the gather is still pending): at once, the same message.
    start = time.monotonic()
    with torch.no_grad(), pytest.raises(RuntimeError, match="waited .* in the all-gather"):
        model(x)
    assert time.monotonic() - start < 1.0


def test_stage3_rank0_only_evaluation_is_told(tmp_path):
    run_ranks(2, rank0_eval_case, 2.0, tmp_path=tmp_path, isolated=True, timeout=120)


def rank0_full_state_dict_case(rank: int, world: int, timeout: float) -> None:
    """nanoGPT's checkpoint, ported: {'optimizer': opt.full_state_dict(), ...} built under
    `if master_process:`. At stage 2 that is a collective rank 0 runs alone: told within the
    limit (ZEROKERN_GATHER_TIMEOUT), naming the fix, instead of the process group's 30
    minutes."""
    import os

    os.environ[told.ENV] = str(timeout)  # isolated ranks, discarded after the case
    torch.manual_seed(0)
    model = _net()
    opt = zerokern.ZeroAdamW(model.parameters(), stage=2, **HP)
    _one_step(model, opt, rank)
    if rank != 0:
        return  # only the master process saves
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        opt.full_state_dict()
    waited = time.monotonic() - start
    assert timeout * 0.95 <= waited < timeout + 30, waited
    msg = str(info.value)
    for part in (f"rank 0 of {world} waited", "full_state_dict() is a collective",
                 "`if master_process:`", told.ENV, "end the process"):
        assert part in msg, (part, msg)


def test_stage2_rank0_only_full_state_dict_is_told(tmp_path):
    run_ranks(2, rank0_full_state_dict_case, 2.0, tmp_path=tmp_path, isolated=True, timeout=120)


def rank0_checkpoint_case(rank: int, world: int, timeout: float, root: str) -> None:
    """zerokern.save_checkpoint / load_checkpoint under `if master_process:` (nanoGPT's habit,
    kept in a port): both are collectives, and rank 0 alone is told so within the limit
    instead of waiting in silence for the process group's 30 minutes. The same short limit
    does not trip a save that every rank runs."""
    import os

    os.environ[told.ENV] = str(timeout)  # isolated ranks, discarded after the case
    torch.manual_seed(0)
    model = _net()
    opt = zerokern.ZeroAdamW(model.parameters(), stage=2, **HP)
    _one_step(model, opt, rank)
    together = os.path.join(root, "together")
    zerokern.save_checkpoint(together, model, opt, extra={"iter": 1})  # every rank
    if rank != 0:
        return  # only the master process saves (and, below, loads)
    alone = os.path.join(root, "alone")
    for call, run, hint in (
        ("save_checkpoint", lambda: zerokern.save_checkpoint(alone, model, opt),
         "no rank-0 guard is needed"),
        # The save's gather is still pending (the error says the group is done for); the
        # load's own first agreement is bounded as well and says what the load needs.
        ("load_checkpoint", lambda: zerokern.load_checkpoint(together, model, opt),
         "zerokern.load_checkpoint(path, plain_model, None)"),
    ):
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout) as info:
            run()
        waited = time.monotonic() - start
        assert timeout * 0.95 <= waited < timeout + 30, (call, waited)
        msg = str(info.value)
        for part in (f"{call}(", f"rank 0 of {world} waited", f"{call} is a collective",
                     "every rank must call it", "`if master_process:`", hint,
                     "docs/checkpoints.md", told.ENV, "end the process"):
            assert part in msg, (part, msg)
    # The lone save staged nothing that stays; the checkpoint saved together is untouched.
    assert not os.path.exists(alone)
    assert not [n for n in os.listdir(root) if ".tmp-" in n], os.listdir(root)
    assert os.path.isfile(os.path.join(together, "meta.json"))


def test_stage2_rank0_only_save_and_load_checkpoint_are_told(tmp_path):
    run_ranks(2, rank0_checkpoint_case, 2.0, str(tmp_path), tmp_path=tmp_path, isolated=True,
              timeout=120)


def slow_rank_case(rank: int, world: int, timeout: float, delay: float, steps: int) -> None:
    torch.manual_seed(0)
    base = _net()
    ours = zerokern.shard_model(copy.deepcopy(base), unit_classes=(Block,),
                                gather_timeout=timeout)
    opt = zerokern.ZeroAdamW(ours.parameters(), stage=3, **HP)
    ref = copy.deepcopy(base)
    ddp = DDP(ref)
    ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    for step in range(steps):
        if rank == 1:
            # A slow data load (or a first step that compiles) on one rank: rank 0 waits for
            # it in the first gather every step, longer than the limit over the whole run.
            time.sleep(delay)
        x, y = _data(step, rank)
        F.cross_entropy(ours(x), y).backward()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        ropt.step()
        ropt.zero_grad()
    full = zerokern.full_state_dict(ours, rank0_only=False)
    for n, p in ref.named_parameters():
        _close(full[n], p.detach(), f"{n} after {steps} steps with a slow rank")


def test_stage3_slow_rank_is_not_a_timeout(tmp_path):
    # Each wait (about 1.5 s) is well under the limit (4 s); together they exceed it.
    run_ranks(2, slow_rank_case, 4.0, 1.5, 4, tmp_path=tmp_path)


def test_stage3_rank0_only_evaluation_exits(exit_zygote):
    """A nanoGPT-style script (evaluation under `if rank == 0` after a step) on real processes:
    both ranks end with an error (exit status 1, no hang, no abort) within the limit, rank 0
    with the message; tests/exit_case.py mode evalrank0."""
    start = time.monotonic()
    res = exit_zygote.run_case(3, "evalrank0")
    elapsed = time.monotonic() - start
    assert [rc for rc, _ in res] == [1, 1], res
    for _, err in res:  # each rank is told why (rank 1 in a gradient reduce-scatter)
        assert "`if rank == 0:`" in err, err
    assert elapsed < 90, elapsed


def test_gather_timeout_setting(monkeypatch):
    monkeypatch.delenv(told.ENV, raising=False)
    assert told.resolve(None) == (told.DEFAULT_S, False)
    assert 60 <= told.DEFAULT_S <= 600  # a few minutes, never torch's 30
    assert told.resolve(7) == (7.0, True)
    monkeypatch.setenv(told.ENV, "12.5")
    assert told.resolve(None) == (12.5, True)
    assert told.resolve(3) == (3.0, True)  # the keyword wins
    monkeypatch.setenv(told.ENV, "soon")
    with pytest.raises(ValueError, match="ZEROKERN_GATHER_TIMEOUT must be a number"):
        told.resolve(None)
    for bad in (0, -1, float("nan"), True, "5"):
        with pytest.raises(ValueError, match="gather_timeout must be a number"):
            told.resolve(bad)
    # gloo: bounded by default; NCCL: only when asked for (a bounded wait blocks the host)
    assert told.wait_limit(300.0, False, "gloo") == 300.0
    assert told.wait_limit(300.0, False, "nccl") is None
    assert told.wait_limit(5.0, True, "nccl") == 5.0
    assert told.wait_limit(math.inf, True, "gloo") is None
    # refused before anything is modified
    model = _net()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="gather_timeout"):
        zerokern.shard_model(model, gather_timeout=0)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


# -- 2. a parameter's tensor replaced ----------------------------------------------------------

def _weight(model: nn.Module) -> nn.Parameter:
    return model[1].fc.weight  # inside a stage-3 unit


def reassign_case(rank: int, world: int, stage: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    base = _net()
    ours = copy.deepcopy(base).to(dtype)
    if stage == 3:
        ours = zerokern.shard_model(ours, unit_classes=(Block,))
    opt = zerokern.ZeroAdamW(ours.parameters(), stage=stage, bucket_numel=61, **HP)
    ref = copy.deepcopy(base)  # fp32: ZeroAdamW's master of a 16-bit model is fp32 too
    ddp = DDP(ref)
    ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    g = torch.Generator().manual_seed(7)  # the same new values on every rank
    for step in range(5):
        new = 0.3 * torch.randn(16, 16, generator=g)
        if step == 2:  # weight surgery before a forward (after the first step)
            _weight(ours).data = new.to(dtype)
            _weight(ref).data = new.clone()
        x, y = _data(step, rank)
        F.cross_entropy(ours(x.to(dtype)).float(), y).backward()
        F.cross_entropy(ddp(x), y).backward()
        if step == 3:  # between backward and step: the step updates the new tensor
            _weight(ours).data = new.to(dtype)
            _weight(ref).data = new.clone()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    full = zerokern.full_state_dict(ours, rank0_only=False)
    for n, p in ref.named_parameters():
        if dtype == torch.float32:
            _close(full[n], p.detach(), f"stage {stage}: {n} after p.data = t")
        else:  # the fp32 master took the new values: bf16 rounding of the reference
            torch.testing.assert_close(full[n].float(), p.detach(), rtol=2e-2, atol=2e-2,
                                       msg=lambda m, n=n: f"stage {stage} bf16: {n}: {m}")
    if stage < 3:  # the parameter is a view of ZeroAdamW's buffer again
        assert _weight(ours).data_ptr() != 0 and all(
            sh.step == 5 for sh in opt.shards() if sh.numel)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_param_data_assignment_trains_the_new_tensor(stage, tmp_path):
    run_ranks(2, reassign_case, stage, torch.float32, tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [1, 3])
def test_param_data_assignment_bf16_master_takes_it(stage, tmp_path):
    run_ranks(2, reassign_case, stage, torch.bfloat16, tmp_path=tmp_path)


def cast_case(rank: int, world: int, stage: int) -> None:
    torch.manual_seed(0)
    model = _net()
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(Block,))
    opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, bucket_numel=61, **HP)
    x, y = _data(0, rank)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    # Live views of the optimizer state (shards() itself refuses a cast model, see below).
    views = [t for sh in opt.shards() for r in sh.ranges
             for t in (r.values, r.exp_avg, r.exp_avg_sq)]
    before = [t.clone() for t in views]
    model.to(torch.bfloat16)
    # torch: "TypeError: tensors[0] has dtype torch.bfloat16, out has torch.float32" deep in
    # the bucket copy (stages 0-2); stage 3 silently went back to float32. Now: told at the
    # first gradient (stages 0-2) or gather (stage 3), naming the cast and what to do.
    with pytest.raises(RuntimeError) as info:
        F.cross_entropy(model(x.bfloat16()).float(), y).backward()
    msg = str(info.value)
    for part in ("is now torch.bfloat16 on cpu but zerokern holds it as torch.float32",
                 "model.to(...)", "cast or move the model before building ZeroAdamW"):
        assert part in msg, (part, msg)
    # ... before anything was updated, and step() refuses too.
    with pytest.raises(RuntimeError, match="is now torch.bfloat16"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(views, before))
    assert all(opt.shards_step(i) == 1 for i in range(len(opt.managed_params)))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cast_after_first_step_is_refused(stage, tmp_path):
    run_ranks(2, cast_case, stage, tmp_path=tmp_path)



@pytest.mark.parametrize("stage", [1, 3])
def test_param_data_of_another_shape_is_refused(stage):
    """torch's AdamW fails too (its state has the old shape); here before anything changes."""
    torch.manual_seed(0)
    model = _net()
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(Block,))
    opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, **HP)
    x, y = _data(0, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    _weight(model).data = torch.zeros(16, 15)
    with pytest.raises(RuntimeError, match=r"now has shape \(16, 15\) but had \(16, 16\)"):
        opt.step()


# -- 3. torch.compile: no global module hook ---------------------------------------------------

def compiled_case(rank: int, world: int, stage: int) -> None:
    torch.manual_seed(0)
    base = _net()
    ours = copy.deepcopy(base)
    if stage == 3:
        ours = zerokern.shard_model(ours, unit_classes=(Block,))
    opt = zerokern.ZeroAdamW(ours.parameters(), stage=stage, bucket_numel=61, **HP)
    # The guard against a DDP wrapper is no global module hook (torch.compile warns about
    # those, and they would run on every module's forward in the process).
    assert not torch.nn.modules.module._has_any_global_hook()
    # "eager": dynamo traces (and would warn) without inductor's C++ compile time.
    compiled = torch.compile(ours, backend="eager")
    ref = copy.deepcopy(base)
    ddp = DDP(ref)
    ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(4):
            x, y = _data(step, rank)
            F.cross_entropy(compiled(x), y).backward()
            opt.step()
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            ropt.step()
            ropt.zero_grad()
    hooks = [str(w.message) for w in seen if "global hooks" in str(w.message)]
    assert not hooks, hooks
    full = zerokern.full_state_dict(ours, rank0_only=False)
    for n, p in ref.named_parameters():
        _close(full[n], p.detach(), f"stage {stage} compiled: {n}")


@pytest.mark.parametrize("stage", [2, 3])
def test_compiled_model_no_global_hook_warning(stage, tmp_path):
    run_ranks(2, compiled_case, stage, tmp_path=tmp_path)


_LATE_IMPORT = """
import tempfile, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
d = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{d}/rv", rank=0, world_size=1)
model = nn.Linear(4, 4)
wrapped = DDP(model)  # before zerokern is imported: its DDP wrapper was not there yet
import zerokern
try:
    zerokern.ZeroAdamW(model.parameters(), stage=2)
except RuntimeError as exc:
    assert "Remove the DDP" in str(exc), exc
    print("refused")
dist.destroy_process_group()
"""


def test_ddp_built_before_zerokern_import_is_refused():
    """The DDP guard needs no hook: a DDP built before zerokern was imported is found once,
    at import, and ZeroAdamW refuses its parameters when it is built."""
    out = subprocess.run([sys.executable, "-c", _LATE_IMPORT], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr[-2000:]
