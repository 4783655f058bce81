#!/usr/bin/env bash
# The checks only a GPU can make, in about 15 minutes, for the first day a GPU machine is lent:
#   bash benchmarks/gpu_smoke.sh [--out benchmarks/results/gpu_smoke.json]
# Exits 2 with one line where there is no CUDA device. Needs 2 GPUs for the multi-GPU checks (with one,
# they are reported as not run). Writes one JSON report naming the device; see benchmarks/gpu_smoke.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PATH="$(dirname "$PY"):$PATH"
exec "$PY" benchmarks/gpu_smoke.py "$@"
