#!/usr/bin/env bash
# One device call (issues 17/16, H200, ~9 min): the warp-split CUDA kernel with two activation tiles (9 <= M <= 16):
# its GPU tests beside every gpu-marked weight-CUDA test, the runtime's compiled-step tests with Inductor's PDL codegen,
# the --cuda-ws16 exploration, the table rebuilt from the committed explorations + it (into the tree copy and $OUT),
# then `lowbit audit kernels --weights` with that table.
# Usage: scripts/gpu_s15_call1.sh "$OUT"      (carry .gpu/cuda: the library built on the CPU host)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 150 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_cuda.py \
    > "$OUT/gpu_tests_cuda.log" 2>&1; echo "cuda tests rc $? $(el)"; grep -E "^FAILED|^E  |passed|failed" "$OUT/gpu_tests_cuda.log" | head -12
timeout -s INT 130 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/runtime/test_gpu_compiled.py \
    > "$OUT/gpu_tests_compiled.log" 2>&1; echo "compiled tests rc $? $(el)"; grep -E "^FAILED|^E  |passed|failed|skipped" "$OUT/gpu_tests_compiled.log" | head -12
timeout -s INT 130 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_ws16.json" --cuda-ws16 > "$OUT/explore.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^cuda-ws|cuBLAS|best" "$OUT/explore.log" | cut -c1-160 | head -30
R=benchmarks/results/weights
python3 benchmarks/build_weight_table.py "$OUT/sm90.json" $R/gemm_explore_run1_NVIDIA_H200.json $R/gemm_explore_gemv_NVIDIA_H200.json \
    $R/gemm_explore_final_NVIDIA_H200.json $R/gemm_explore_cuda_NVIDIA_H200.json $R/gemm_explore_quick_NVIDIA_H200.json \
    $R/gemm_explore_s12_NVIDIA_H200.json $R/gemm_explore_a8_NVIDIA_H200.json $R/gemm_explore_a8_split_NVIDIA_H200.json \
    $R/gemm_explore_swap_NVIDIA_H200.json $R/gemm_explore_ws_NVIDIA_H200.json $R/gemm_explore_pdl_NVIDIA_H200.json \
    "$OUT/gemm_explore_ws16.json" > "$OUT/table.log" 2>&1
echo "table rc $?"; grep -E "w4a16  M (9|1-1)" "$OUT/table.log" | head -16; cp "$OUT/sm90.json" src/lowbit/kernels/weight_tables/sm90.json
timeout -s INT 170 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights.json" > "$OUT/audit_weights.log" 2>&1
echo "audit rc $? $(el)"; tail -4 "$OUT/audit_weights.log"
