#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: the zerokern demo (stages 0-3 side by side
# on 2 CPU ranks over gloo, or on the GPUs with NCCL). Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m zerokern demo "$@"
