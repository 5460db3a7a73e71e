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
# Two pytest-xdist workers (the CI machine's 2 cores: much of the suite waits on rank
# processes and subprocesses, which one pytest process leaves a core idle for).
# ZK_TEST_WORKERS=N runs N, 0 runs every test in this one process. --dist loadfile: a test
# file's module fixtures (a compile, a training run) are built once, on one worker; files go
# in their own order (the slow launches come early, so no worker waits alone at the end).
# Extra arguments come last (`-n 0` there wins too).
WORKERS=${ZK_TEST_WORKERS:-2}
XDIST=()
if [ "$WORKERS" != 0 ]; then
  XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
fi
python -m pytest -q --durations=10 ${XDIST[@]+"${XDIST[@]}"} "$@"
# The documentation site: a broken link or an undocumented public API object fails the build.
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir site
echo "test.sh: docs built (mkdocs build --strict, site/)"
echo "test.sh: passed in $SECONDS s (set-up included)"
