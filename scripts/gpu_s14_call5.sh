#!/usr/bin/env bash
# One device call (issues 17/16, H200, ~9 min): programmatic dependent launch for the CUDA weight kernels: GPU tests,
# the --cuda-pdl exploration, the table rebuilt from the committed explorations + it (into the tree copy and $OUT),
# `lowbit audit kernels --weights`, `lowbit bench gemm`, then W4A16 + int2 B=1 L=32k end to end with it.
# Usage: scripts/gpu_s14_call5.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 120 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_cuda.py \
    > "$OUT/gpu_tests.log" 2>&1; echo "tests rc $? $(el)"; grep -E "^FAILED|^E  |passed|failed" "$OUT/gpu_tests.log" | head -12
timeout -s INT 120 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_pdl.json" --cuda-pdl > "$OUT/explore.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^cuda-pdl" "$OUT/explore.log" | cut -c1-150
R=benchmarks/results/weights
python3 benchmarks/build_weight_table.py "$OUT/sm90.json" $R/gemm_explore_run1_NVIDIA_H200.json $R/gemm_explore_gemv_NVIDIA_H200.json \
    $R/gemm_explore_final_NVIDIA_H200.json $R/gemm_explore_cuda_NVIDIA_H200.json $R/gemm_explore_quick_NVIDIA_H200.json \
    $R/gemm_explore_s12_NVIDIA_H200.json $R/gemm_explore_a8_NVIDIA_H200.json $R/gemm_explore_a8_split_NVIDIA_H200.json \
    $R/gemm_explore_swap_NVIDIA_H200.json $R/gemm_explore_ws_NVIDIA_H200.json "$OUT/gemm_explore_pdl.json" > "$OUT/table.log" 2>&1
echo "table rc $?"; grep -E "w4a16" "$OUT/table.log" | head -24; cp "$OUT/sm90.json" src/lowbit/kernels/weight_tables/sm90.json
timeout -s INT 170 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights.json" > "$OUT/audit_weights.log" 2>&1
echo "audit rc $? $(el)"; tail -4 "$OUT/audit_weights.log"
timeout -s INT 170 python3 -m lowbit bench gemm --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; echo "bench rc $? $(el)"
grep -E "^(w4a16-g128) .*M=(1|4|8|16) " "$OUT/gemm.log" | cut -c1-120 | head -40
timeout -s INT 240 python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10 --batch 1 \
    --paths hf-static-compile-bf16,lowbit-w4a16-int2-compiled --out "$OUT/decode_e2e_w4a16_B1.json" > "$OUT/e2e.log" 2>&1
echo "e2e rc $? $(el)"; grep -E "ms/step|wq_" "$OUT/e2e.log" | head -12
