#!/usr/bin/env bash
# One device call: the last weight-kernel exploration, the H200 dispatch table built from all committed
# explorations, then `lowbit bench gemm`, the W4A16 + int2 decode rows and `lowbit audit kernels --weights`
# with that table.
set -u
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=benchmarks/results/weights
timeout -s INT ${FINAL_S:-120} python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_final.json" --final > "$OUT/explore_final.log" 2>&1; echo "final explore rc $?"
grep -E "^final" "$OUT/explore_final.log"
python3 benchmarks/build_weight_table.py src/lowbit/kernels/weight_tables/sm90.json $R/gemm_explore_run1_NVIDIA_H200.json $R/gemm_explore_gemv_NVIDIA_H200.json "$OUT/gemm_explore_final.json" | tee "$OUT/table.txt"
cp src/lowbit/kernels/weight_tables/sm90.json "$OUT/sm90.json"
timeout -s INT ${BENCH_S:-170} python3 -m lowbit bench gemm --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; echo "bench rc $?"
grep -E "M=(1|4|16|4096) " "$OUT/gemm.log" | grep -E "gate/up|down" | head -30
timeout -s INT ${E2E_S:-110} python3 -m lowbit bench decode --batch 1,16 --length 32k --paths lowbit-int2,lowbit-w4a16-int2 --steps 20 --out "$OUT/decode_e2e.json" > "$OUT/decode_e2e.log" 2>&1; echo "e2e rc $?"
grep -E "ms/step|weights " "$OUT/decode_e2e.log" | tail -6
timeout -s INT ${AUDIT_S:-110} python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights.json" > "$OUT/audit_weights.log" 2>&1; echo "audit rc $?"
tail -6 "$OUT/audit_weights.log"
