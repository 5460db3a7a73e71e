"""zerokern.integrations.lightning.ZeroStrategy against Lightning's own DDPStrategy.

The multi-rank cases (tests/lightning_cases.py) run on 2 fresh CPU ranks over gloo, formed by
a file rendezvous before any Trainer exists (Lightning then uses that process group as it is):
fresh ranks, not the shared pool, because Lightning keeps process-wide state. Importing
Lightning takes most of the time, so every case runs in one job (a module fixture) and each
test here reports its own case.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import run_ranks

WORLD = 2
TIMEOUT_S = 300.0

# Checked without importing Lightning in this process (seconds of imports the ranks pay
# anyway).
needs_lightning = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None,
    reason="pytorch-lightning is not installed (pip install pytorch-lightning)")


def _job(rank: int, world: int, **kwargs: str) -> None:
    import lightning_cases  # in the rank: Lightning is imported there only

    lightning_cases.run_cases(rank, world, **kwargs)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str | None]:
    tmp = tmp_path_factory.mktemp("lightning")
    results = tmp / "results"
    results.mkdir()
    try:
        run_ranks(WORLD, _job, {"tmp": str(tmp), "results": str(results)}, tmp_path=tmp,
                  kwargs=True, isolated=True, timeout=TIMEOUT_S)
    except AssertionError as exc:
        return results, str(exc)
    return results, None


def _check(cases: tuple[Path, str | None], name: str) -> None:
    results, error = cases
    if all((results / f"{name}.rank{r}.ok").exists() for r in range(WORLD)):
        return
    errs = [f"--- rank {r} ---\n{p.read_text()}" for r in range(WORLD)
            if (p := results / f"{name}.rank{r}.err").exists()]
    if errs:
        pytest.fail("\n".join(errs), pytrace=False)
    pytest.fail(f"case {name!r} did not run (the job stopped before it):\n{error}",
                pytrace=False)


@needs_lightning
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_matches_ddp_clips_and_resumes(cases, stage):
    """20 steps, accumulate_grad_batches=2, clipping that fires at every step: losses,
    pre-clip norms and parameters as DDPStrategy + torch AdamW (fp32); resumed in a fresh
    Trainer from the step-10 checkpoint (its own directory, and DDP's file) to the same
    step-20 parameters."""
    _check(cases, f"stage{stage}")


@needs_lightning
def test_habits_and_refusals(cases):
    """Manual optimization, ZeroAdamW's loss scaler, validate(ckpt_path=directory), and the
    configurations refused at setup (torch optimizer, stage mismatch, clip by value)."""
    _check(cases, "habits")


@needs_lightning
def test_evaluation_from_a_checkpoint_after_fit(cases):
    """validate(ckpt_path=...) on the Trainer that has just fit at stage 3."""
    _check(cases, "eval_after_fit")


@needs_lightning
def test_a_second_fit_of_the_same_module(cases):
    """A new Trainer fits the same LightningModule again (stage 2 vs DDPStrategy)."""
    _check(cases, "refit")


@needs_lightning
def test_constructor_refusals(cases):
    _check(cases, "constructor")


def test_importing_zerokern_does_not_import_lightning():
    code = ("import sys, zerokern, zerokern.integrations; "
            "bad = [m for m in ('pytorch_lightning', 'lightning', 'lightning_fabric') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_lightning_names_the_package(monkeypatch):
    # As if pytorch_lightning were not installed (None in sys.modules: import raises).
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    monkeypatch.delitem(sys.modules, "zerokern.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=r"needs the 'pytorch-lightning' package.*"
                                          r"pip install pytorch-lightning"):
        importlib.import_module("zerokern.integrations.lightning")


@needs_lightning
def test_stage3_on_a_2x2_mesh_with_int8_moments_matches_zero_adamw(tmp_path):
    """Issue 36 item 5: ZeroStrategy(stage=3, mesh=(2, 2), moments="int8"), the options as
    one ZeroConfig and as keywords, trains to the same bits as shard_model + ZeroAdamW by
    hand (4 fresh ranks: Lightning keeps process-wide state)."""
    results = tmp_path / "results"
    results.mkdir()
    try:
        run_ranks(4, _mesh_job, {"tmp": str(tmp_path), "results": str(results)},
                  tmp_path=tmp_path, kwargs=True, isolated=True, timeout=TIMEOUT_S)
    except AssertionError as exc:
        errs = [p.read_text() for p in sorted(results.glob("mesh.rank*.err"))]
        pytest.fail("\n".join(errs) or str(exc), pytrace=False)
    assert all((results / f"mesh.rank{r}.ok").exists() for r in range(4))


def _mesh_job(rank: int, world: int, **kwargs: str) -> None:
    import lightning_mesh_cases  # in the rank: Lightning is imported there only

    lightning_mesh_cases.run(rank, world, **kwargs)
