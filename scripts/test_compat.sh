#!/usr/bin/env bash
# The GPU machine's own stack on this CPU machine: a second virtualenv (.compat/venv) with the
# oldest torch we support (2.11.0, which brings Triton 3.6.0), a copy of the tree (.compat/tree,
# so the main tree's in-place build is left alone) built against it, and the tests that a
# version change can break: the CPU kernel tests (ops, arena), every Triton kernel compiled for
# sm_90 by Triton 3.6 (what the GPU machine runs; what the kernels compute is checked under the
# interpreter by the main suite, and on a GPU by bench/gpu_check.sh with this very stack), one
# 2-rank parity case per stage, and two exit cases.
# .ci/run runs it after the main suite. Budget: 5 minutes here with the wheels cached.
#   bash scripts/test_compat.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
COMPAT=${ZEROKERN_COMPAT_DIR:-$ROOT/.compat}
TORCH_SPEC=${ZEROKERN_COMPAT_TORCH:-torch==2.11.0}
# Triton 3.6's interpreter calls int() on one-element numpy arrays, which numpy 2.4 removed
# (every runtime loop bound fails under TRITON_INTERPRET=1; compiled kernels are unaffected).
NUMPY_SPEC=${ZEROKERN_COMPAT_NUMPY:-numpy<2.4}
PY=${PYTHON:-python3}

if [ ! -x "$COMPAT/venv/bin/python" ]; then
  mkdir -p "$COMPAT"
  "$PY" -m venv "$COMPAT/venv"
fi
# shellcheck disable=SC1091
. "$COMPAT/venv/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  echo "compat: installing $TORCH_SPEC"
  python -m pip install -q --upgrade pip >/dev/null
  python -m pip install -q "$TORCH_SPEC"
fi
python -m pip install -q "setuptools>=64" wheel "pybind11>=2.10" ninja pytest "$NUMPY_SPEC" \
  safetensors

# The tree as it is now (tracked and untracked files, not what git ignores), copied afresh into
# .compat/tree with their times kept; build/ stays, so the native build there is incremental.
mkdir -p "$COMPAT/tree"
find "$COMPAT/tree" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$COMPAT/tree"
cd "$COMPAT/tree"
export MAX_JOBS=${MAX_JOBS:-2} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
echo "compat: building zerokern._C against $(python -c 'import torch; print(torch.__version__)')"
python -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v -i "warning\|^ *$\|\*\*\*\|!!\|careful\|name as your\|with strategy" || true
python -c "import sys, numpy, torch, triton, zerokern as z; print('compat: python', \
sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, \
'| numpy', numpy.__version__, '| native', z.has_native(), '| cuda kernels', z.has_cuda_kernels())"

python -m pytest -q -p no:cacheprovider \
  tests/test_ops_adamw.py tests/test_ops_sq_norm.py tests/test_ops_flatten.py \
  tests/test_arena.py tests/test_triton_compile.py \
  "tests/test_zero_parity.py::test_fp32_matches_adamw[0-2]" \
  "tests/test_zero_parity.py::test_fp32_matches_adamw[1-2]" \
  "tests/test_zero_parity.py::test_fp32_matches_adamw[2-2]" \
  "tests/test_stage3.py::test_gpt_fp32_matches_adamw[2]" \
  "tests/test_offload.py::test_offload_bitwise_equal_to_no_offload[2-2]" \
  "tests/test_offload.py::test_offload_params_bitwise_equal_to_no_offload[2]" \
  "tests/test_exit.py::test_exit_clean[2-destroy-0]" \
  "tests/test_exit.py::test_exit_clean[3-nodestroy-0]" \
  "$@"
