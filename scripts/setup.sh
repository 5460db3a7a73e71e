#!/usr/bin/env bash
# Set up a fresh machine for zerokern: a virtualenv in .venv, torch, the test/bench and docs tools,
# then build the native module against that torch (CUDA kernels when nvcc is found).
# Idempotent: a second run reuses .venv and rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH_SPEC=${ZEROKERN_TORCH:-torch==2.14.1}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
if ! python -c "import torch" 2>/dev/null; then
  echo "setup: installing $TORCH_SPEC (local wheel cache, about a minute)"
  python -m pip install -q "$TORCH_SPEC"
fi
python -m pip install -q "setuptools>=64" wheel "pybind11>=2.10" ninja pytest "pytest-xdist>=3.8" \
  ruff numpy hypothesis safetensors matplotlib transformers accelerate pytorch-lightning
# The documentation tools (pyproject.toml's `docs` extra): scripts/test.sh builds the site.
python -m pip install -q "mkdocs>=1.6" "mkdocs-material>=9.5" "mkdocstrings-python>=2.0"

# nvcc is optional: with it the CUDA kernels compile (they cannot run without a GPU).
# setup.py finds the toolkit behind the nvcc on PATH (CUDA_HOME overrides).
export MAX_JOBS=${MAX_JOBS:-2}
echo "setup: building zerokern._C"
python -m pip install -q --no-build-isolation --no-deps -e .
python -c "import zerokern as z; print('setup: zerokern', z.__version__, '| native:', z.has_native(), '| cuda kernels:', z.has_cuda_kernels())"
