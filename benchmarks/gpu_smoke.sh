#!/usr/bin/env bash
# The checks only a GPU can make, in about 15 minutes, for the first day a GPU machine is lent:
#   bash benchmarks/gpu_smoke.sh [--out benchmarks/results/gpu_smoke.json]
# Exits 2 with one line where there is no CUDA device. With one GPU, segments, sampling (two batch sizes),
# a foreign reference and channels_last run on it; killing one rank needs 2 GPUs and is reported as not run. Writes one JSON report naming the device; see benchmarks/gpu_smoke.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PATH="$(dirname "$PY"):$PATH"
exec "$PY" benchmarks/gpu_smoke.py "$@"
