"""ZeroTrainer (zerokern.integrations.transformers) on 2 gloo ranks against the plain HF
Trainer with torch AdamW and its DDP: the same losses, logged grad norms and parameters at
stages 0-3 with accumulation and clipping that fires; save at step 10 and resume; save_model
writes a loadable HF checkpoint; a plain Trainer given a ZeroAdamW is refused."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed")

import hf_cases  # noqa: E402
from dist_utils import run_ranks  # noqa: E402


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_trainer_matches_trainer_with_ddp_and_resumes(stage, tmp_path):
    run_ranks(2, hf_cases.parity_and_resume, stage, str(tmp_path), tmp_path=tmp_path)


def test_zero_trainer_with_sgd_matches_trainer_with_ddp_and_sgd(tmp_path):
    run_ranks(2, hf_cases.sgd_matches_trainer_with_ddp, str(tmp_path), tmp_path=tmp_path)


def test_plain_trainer_with_zero_adamw_is_refused(tmp_path):
    run_ranks(2, hf_cases.plain_trainer_is_refused, str(tmp_path), tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_a_plain_trainer_checkpoint(stage, tmp_path):
    run_ranks(2, hf_cases.resume_from_plain_trainer, stage, str(tmp_path), tmp_path=tmp_path)


def test_options_and_refusals(tmp_path):
    run_ranks(2, hf_cases.options_and_refusals, str(tmp_path), tmp_path=tmp_path)


# -- options (issue 36 item 5): one ZeroConfig, mesh=, checked before the model changes ------
def test_mesh_and_reduce_dtype_match_zero_adamw(tmp_path):
    import hf_config_cases

    run_ranks(4, hf_config_cases.mesh_and_reduce_dtype, str(tmp_path), tmp_path=tmp_path)


def test_config_whole_equals_keywords(tmp_path):
    import hf_config_cases

    run_ranks(2, hf_config_cases.config_whole_equals_keywords, str(tmp_path),
              tmp_path=tmp_path)


def test_bad_options_are_refused_before_the_model_is_sharded(tmp_path):
    import hf_config_cases

    run_ranks(2, hf_config_cases.refused_before_the_model_is_sharded, str(tmp_path),
              tmp_path=tmp_path)
