#!/usr/bin/env bash
# s23 call 1 (H200; carry .gpu/cuda): the tiled 4-bit weight kernel (kernels/cuda/weight_tiled.cu): its GPU tests
# against the twin, then `gemm_explore.py --cuda-tiled` (M 17-1024 beside the tabled cell and dequantize + cuBLAS).
# Usage: scripts/gpu_s23_call1.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 240 python3 -m pytest -q --tb=short -p no:cacheprovider -p no:logging -x \
    tests/kernels/test_weight_tiled.py > "$OUT/gpu_tests_tiled_s23_NVIDIA_H200.log" 2>&1; echo "tests rc $? $(el)"
grep -E "^E |passed|failed|Error" "$OUT/gpu_tests_tiled_s23_NVIDIA_H200.log" | head -12
timeout -s INT 300 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_tiled_s23_NVIDIA_H200.json" --cuda-tiled \
    > "$OUT/gemm_explore_tiled_s23_NVIDIA_H200.log" 2>&1; echo "explore rc $? $(el)"
grep -E "best" "$OUT/gemm_explore_tiled_s23_NVIDIA_H200.log" | sed 's/^cuda-tiled //' | cut -c1-150
