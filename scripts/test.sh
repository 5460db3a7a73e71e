#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite on this machine: CPU kernels,
# Triton under the interpreter, multi-rank gloo tests; GPU tests run when a GPU is present;
# then builds the documentation site (mkdocs build --strict) into site/.
# Prints the 10 slowest tests and the wall time, set-up included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
python -m pytest -q --durations=10 "$@"
# The documentation site: a broken link or an undocumented public API object fails the build.
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir site
echo "test.sh: docs built (mkdocs build --strict, site/)"
echo "test.sh: passed in $SECONDS s (set-up included)"
