"""Every axis of ZeroAdamW on the GPU against the CPU oracle, bit for bit, at the engine level:
stages 0-3 (fp32 and bf16 parameters), int8 and bf16 moments, ``master="none"``, offload
(``offload="cpu"``, with ``shard_model(offload_params=True)`` at stage 3), ``reduce_dtype=
torch.float32`` with bf16 parameters, and meshes (1 x N, the degenerate 1 x 1 on one GPU; 2 x
N/2 on 4 or more GPUs). Each case trains the same model from the same initial bits on the same
batches twice in the test: on CUDA over NCCL and on the CPU over gloo, and compares every
parameter and this rank's optimizer state as stored (tests/axes_harness.py says why bitwise is
the right expectation, and what is compared).

Marked gpu: skipped without CUDA; bench/gpu_check.sh runs it right after the build, on one GPU
(world size 1) and on all of them when there are several (a power of two of them: the
averaging's division is exact only then on both devices, see _run).
tests/test_gpu_axes_harness.py runs the same harness CPU against CPU without a GPU (it passes
equal runs, fails different ones).
"""

from __future__ import annotations

import pytest
import torch
from axes_harness import CASES, compare_sides, mesh_shape

import zerokern

pytestmark = pytest.mark.gpu


def _need_gpu() -> None:
    if not torch.cuda.is_available() or not zerokern.has_cuda_kernels():
        pytest.skip("needs a GPU and the CUDA kernels")


def _run(world: int, case: str, tmp_path) -> None:
    try:
        mesh_shape(CASES[case], world)
    except ValueError as e:
        pytest.skip(str(e))
    if world & (world - 1):
        # The engines average by t.div_(N). torch's CUDA division by a Python scalar is a
        # multiply by its fp32 reciprocal, the CPU's a true division: for N not a power of
        # two the averaged gradients may differ in their last bit, and so the whole run.
        pytest.skip(f"bitwise needs a power-of-two world size, this machine has {world} GPUs")
    compare_sides(world, case, tmp_path, device="cuda", backend="nccl")


@pytest.mark.parametrize("case", CASES)
def test_one_gpu_matches_cpu_oracle(case, tmp_path):
    _need_gpu()
    _run(1, case, tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_all_gpus_match_cpu_oracle(case, tmp_path):
    _need_gpu()
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip(f"needs 2 or more GPUs, this machine has {world}")
    _run(world, case, tmp_path)
