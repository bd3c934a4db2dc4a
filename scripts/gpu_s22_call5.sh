#!/usr/bin/env bash
# s22 call 5 (H200; carry .gpu/cuda): every kernel GPU test on the final tree of s22 (the weight library now built
# through lowbit.kernels.nvcc, the latent CUDA middle as the default, the geometry kernel's SPLIT0).
# Usage: scripts/gpu_s22_call5.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 scripts/place_cuda_lib.py
timeout -s INT 540 python3 -m pytest -q --tb=short -p no:cacheprovider -p no:logging --durations=10 -m gpu \
    tests/kernels > "$OUT/gpu_tests_kernels_s22_NVIDIA_H200.log" 2>&1; echo "tests rc $?"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_kernels_s22_NVIDIA_H200.log" | tail -12
