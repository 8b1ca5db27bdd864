#!/usr/bin/env bash
# VGG16 training images/s on this machine's CUDA GPU: fp32 (TF32), bf16, bf16 + channels-last,
# bf16 + channels-last + compile, from synthetic tensors and from the cache, each with its share of
# the GPU's peak; for bf16 + channels-last also from the JPEG files, decoded by loader workers and on
# the GPU (--decode device), each with its ratio to the cached rate; JSON in benchmarks/results/gpu.json.
# Under 8 minutes (hard limit 470 s).
# Without a GPU it says so and exits 0. Extra arguments go to benchmarks/gpu_bench.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch' || { echo "benchmarks/gpu.sh: cannot import torch with $PY" >&2; exit 1; }
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "benchmarks/gpu.sh: no CUDA GPU on this machine; nothing to measure (run it where torch.cuda.is_available())"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 470 "$PY" benchmarks/gpu_bench.py "$@"
