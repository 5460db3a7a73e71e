"""ZeroAccelerator (zerokern.integrations.accelerate) on 2 gloo ranks: Accelerate's own loop
(prepare, accumulate, clip_grad_norm_, save_state / load_state) gives the losses, norms and
parameters of accelerate.Accelerator + DDP + torch AdamW at stages 1-3 and resumes exactly;
what would train wrong is refused."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed")
pytest.importorskip("transformers", reason="transformers is not installed (the tiny GPT-2)")

import accelerate_cases as cases  # noqa: E402
from dist_utils import run_ranks  # noqa: E402


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_accelerator_matches_accelerator_with_ddp_and_resumes(stage, tmp_path):
    run_ranks(2, cases.parity_and_resume, stage, str(tmp_path), tmp_path=tmp_path)


@pytest.mark.parametrize("case", [cases.torch_optimizer_is_refused, cases.fp16_is_refused,
                                  cases.plain_accelerator_is_refused,
                                  cases.skipped_step_is_reported],
                         ids=lambda f: f.__name__)
def test_refusals(case, tmp_path):
    run_ranks(2, case, tmp_path=tmp_path)
