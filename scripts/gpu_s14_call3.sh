#!/usr/bin/env bash
# One device call (issue 17, H200, ~8 min): the warp-split CUDA kernel (x from L1, v1) after the shared-memory-x
# variant lost: GPU tests, the --cuda-ws exploration (with the runtime's fused q|k|v and gate|up shapes), the table
# rebuilt from the committed explorations + it (buckets 5-8 / 9-16, shape cells; into the tree copy and $OUT), then
# `lowbit audit kernels --weights` and `lowbit bench gemm` with it.
# Usage: scripts/gpu_s14_call3.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 120 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_cuda.py \
    > "$OUT/tests.log" 2>&1; echo "tests rc $? $(el)"; grep -E "^FAILED|^E  |passed|failed" "$OUT/tests.log" | head -12
timeout -s INT 120 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_ws.json" --cuda-ws > "$OUT/explore.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^cuda-ws .*M=(1|8) |cuBLAS" "$OUT/explore.log" | cut -c1-150
R=benchmarks/results/weights
python3 benchmarks/build_weight_table.py "$OUT/sm90.json" $R/gemm_explore_run1_NVIDIA_H200.json $R/gemm_explore_gemv_NVIDIA_H200.json \
    $R/gemm_explore_final_NVIDIA_H200.json $R/gemm_explore_cuda_NVIDIA_H200.json $R/gemm_explore_quick_NVIDIA_H200.json \
    $R/gemm_explore_s12_NVIDIA_H200.json $R/gemm_explore_a8_NVIDIA_H200.json $R/gemm_explore_a8_split_NVIDIA_H200.json \
    $R/gemm_explore_swap_NVIDIA_H200.json "$OUT/gemm_explore_ws.json" > "$OUT/table.log" 2>&1
echo "table rc $?"; grep -E "w4a16" "$OUT/table.log" | head -24; cp "$OUT/sm90.json" src/lowbit/kernels/weight_tables/sm90.json
timeout -s INT 170 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights.json" > "$OUT/audit_weights.log" 2>&1
echo "audit rc $? $(el)"; tail -4 "$OUT/audit_weights.log"
timeout -s INT 170 python3 -m lowbit bench gemm --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; echo "bench rc $? $(el)"
grep -E "^(w4a16-g128|w8a16) .*M=(1|4|8) " "$OUT/gemm.log" | cut -c1-120 | head -40
