#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite on this machine: CPU kernels,
# Triton under the interpreter, multi-rank gloo tests; GPU tests run when a GPU is present.
# Prints the 10 slowest tests and the wall time, set-up included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
python -m pytest -q --durations=10 "$@"
echo "test.sh: passed in $SECONDS s (set-up included)"
