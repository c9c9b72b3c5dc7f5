#!/usr/bin/env bash
# One-call GPU check (see scripts/gpu_check.py): CUDA tests, bandwidth, overlap, memory plan
# against peaks, and the OPT-13B paper setting. `--dry-run` runs every step on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python scripts/gpu_check.py "$@"
