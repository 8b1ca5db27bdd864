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
# One interpreter for both questions (importing torch takes seconds): 3 = no torch, 4 = no CUDA GPU.
found=0
"$PY" -c 'import sys
try:
    import torch
except Exception:
    sys.exit(3)
sys.exit(0 if torch.cuda.is_available() else 4)' || found=$?
if [ "$found" = 3 ]; then echo "benchmarks/gpu.sh: cannot import torch with $PY" >&2; exit 1; fi
if [ "$found" = 4 ]; then
  echo "benchmarks/gpu.sh: no CUDA GPU on this machine; nothing to measure (run it where torch.cuda.is_available())"
  exit 0
fi
if [ "$found" != 0 ]; then echo "benchmarks/gpu.sh: $PY failed ($found) checking for torch and a GPU" >&2; exit 1; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 470 "$PY" benchmarks/gpu_bench.py "$@"
