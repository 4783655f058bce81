#!/usr/bin/env bash
# The checks only a GPU can make, for a lent GPU machine (see benchmarks/gpu_smoke.py):
#   make gpu-bundle                                   # here, once: build/gpu-bundle.tar.xz
#   bash benchmarks/gpu_smoke.sh --out-dir "$OUT"     # there, with build/ carried
# Exits 2 with one line where there is no CUDA device. Runs on the machine's python3 (its torch); the bundle
# brings the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_smoke.py "$@"
