#!/usr/bin/env bash
# GPU check (docs/gpu.md): on a machine with CUDA, run the GPU tests (pytest -m gpu) and print
# tokens/s and peak memory of the 124m preset for the local trainer and a one-GPU local swarm.
# `--dry-run`: the same on the CPU with the tiny preset and a few iterations (CI runs it).
# Every other option goes to benchmarks/gpu_check.py (--out DIR, --json PATH, --precisions ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
export MPLBACKEND=${MPLBACKEND:-Agg}
exec "$PY" benchmarks/gpu_check.py "$@"
