#!/usr/bin/env bash
# s23 call 3 (H200; carry .gpu/cuda): the tiled kernel with each block's K walk rotated (call 2: the L2 prefetch size
# changed nothing, ~0.9 TB/s): GPU tests, then `gemm_explore.py --cuda-tiled` (the full sweep of call 1).
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 200 python3 -m pytest -q --tb=short -p no:cacheprovider -p no:logging -x \
    tests/kernels/test_weight_tiled.py > "$OUT/gpu_tests_tiled_rot_s23_NVIDIA_H200.log" 2>&1; echo "tests rc $? $(el)"
grep -E "^E |passed|failed|Error" "$OUT/gpu_tests_tiled_rot_s23_NVIDIA_H200.log" | head -12
timeout -s INT 300 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_tiled_rot_s23_NVIDIA_H200.json" --cuda-tiled \
    > "$OUT/gemm_explore_tiled_rot_s23_NVIDIA_H200.log" 2>&1; echo "explore rc $? $(el)"
grep -E "best" "$OUT/gemm_explore_tiled_rot_s23_NVIDIA_H200.log" | sed "s/^cuda-tiled //" | cut -c1-150
