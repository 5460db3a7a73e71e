#!/usr/bin/env bash
# One prepared run on a lent GPU (see the device tool's README): build the extension, run the
# gpu-marked tests and the benchmarks, write logs and CSVs into the folder given (default
# $OUT). Budget: about 12 minutes on an H200 (the offload steps up to 10: run them alone
# with a filter when device time is short). At most 8 files come back, so the logs are
# concatenated into gpu_check.log and only the CSVs sit beside it.
#   bash bench/gpu_check.sh "$OUT"
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-${OUT:-bench/results/gpu}}
mkdir -p "$DEST"
LOG="$DEST/gpu_check.log"
TMP=$(mktemp -d)
say() { echo "== $*" | tee -a "$LOG"; }
step() {  # step NAME TIMEOUT CMD... : run, log, record status, never abort the script
  local name=$1 limit=$2; shift 2
  say "$name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "$name rc=$rc ($((SECONDS - t0)) s)" | tee -a "$DEST/summary.txt" "$LOG"
  return 0
}

: >"$LOG"; : >"$DEST/summary.txt"
# The versions first: the lent machine has its own stack (torch 2.11 / Triton 3.6 so far).
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import sys, numpy, torch, triton; print('python', sys.version.split()[0], \
'| torch', torch.__version__, '| cuda', torch.version.cuda, '| triton', triton.__version__, \
'| numpy', numpy.__version__)"; } 2>&1 | tee -a "$LOG" "$DEST/summary.txt"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
step build 420 python3 -m pip install --no-build-isolation --no-deps -e .
python3 -c "import zerokern as z; print('native', z.has_native(), 'cuda kernels', z.has_cuda_kernels())" 2>&1 | tee -a "$LOG" "$DEST/summary.txt"
# The quick subset first (the same one scripts/test_compat.sh runs on CPU, here on the GPU):
# the op tests of every backend, then the world-1 NCCL bf16 step of each stage. A short device
# call reports these even if a later step fails or its time runs out.
step quick_ops 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_ops_adamw.py tests/test_ops_sq_norm.py tests/test_ops_flatten.py
step quick_compressed 240 python3 -m pytest -q --maxfail=5 -p no:cacheprovider tests/test_gpu_adamw_compressed.py
step quick_nccl 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_zero.py -k bfloat16
# The offload paths (pinned host arena, side-stream copies, events) have never run on a GPU:
# their gpu-marked tests come right after the quick subset.
step offload_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_offload.py
step gpu_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_kernels.py tests/test_gpu_zero.py
step triton_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_*.py
step bench_adam 150 python3 bench/bench_adam.py --device cuda --out "$TMP"
step bench_memory 60 python3 bench/bench_memory.py --device cuda --quick --out "$TMP"
step bench_zero 120 python3 bench/bench_zero.py --world-size 1 --steps 20 --out "$TMP"
# ZeRO-Offload: step time and device/host memory with and without offload (DeepSpeed's offload rows
# when it is installed), then the largest model fitting a 2 GB device budget.
step bench_offload 180 python3 bench/bench_offload.py --device cuda --world-size 1 --steps 15 --repeats 1 --out "$TMP"
step bench_offload_fit 300 python3 bench/bench_offload.py --device cuda --world-size 1 --steps 3 --repeats 1 --policies zk_stage2 zk_stage2_offload --fit-budget-gb 2 --fit-embd 1024 --fit-max-layers 64 --out "$TMP"
# Keep at most 6 CSVs (8 files come back in all, with the log and the summary).
ls -1 "$TMP"/*.csv 2>/dev/null | head -6 | while read -r f; do cp "$f" "$DEST/"; done
cat "$DEST/summary.txt"
