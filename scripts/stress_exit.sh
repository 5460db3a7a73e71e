#!/usr/bin/env bash
# Exit stress: run each 2-rank exit case (stages 0-3 x destroy/nodestroy/alive/exception, see
# tests/exit_case.py) N times and print how many runs exited non-zero. Exit status 1 if any.
#   bash scripts/stress_exit.sh 25 [--stages 2 3] [--modes destroy]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && . .venv/bin/activate
python tests/exit_launch.py "$@"
