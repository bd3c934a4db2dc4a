#!/usr/bin/env bash
# s24 call 1 (H200; carry .gpu/cuda): the tiled kernel's wgmma instances (-wg): GPU tests of the tiled file, then
# `gemm_explore.py --cuda-wgmma` (M 17-4096, g128 and g64-asym, 8B and fused shapes).
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
nvcc --version | tail -2
python3 scripts/place_cuda_lib.py
timeout -s INT 240 python3 -m pytest -q --tb=short -p no:cacheprovider -p no:logging \
    tests/kernels/test_weight_tiled.py > "$OUT/gpu_tests_tiled_wg_s24_NVIDIA_H200.log" 2>&1; echo "tests rc $? $(el)"
grep -E "^E |passed|failed|Error|FAIL" "$OUT/gpu_tests_tiled_wg_s24_NVIDIA_H200.log" | head -20
X=benchmarks/results/weights/gemm_explore_wgmma_s24_NVIDIA_H200.json
timeout -s INT 240 python3 benchmarks/gemm_explore.py $X --cuda-wgmma > "$OUT/gemm_explore_wgmma_s24_NVIDIA_H200.log" 2>&1
echo "explore rc $? $(el)"; cp $X "$OUT/"
grep -E "best" "$OUT/gemm_explore_wgmma_s24_NVIDIA_H200.log" | grep "g128" | sed "s/^cuda-wgmma //" | cut -c1-150
