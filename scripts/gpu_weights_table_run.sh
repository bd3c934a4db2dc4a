#!/usr/bin/env bash
# One device call with the committed H200 table (src/lowbit/kernels/weight_tables/sm90.json): the W4A16 + int2
# decode rows, `lowbit bench gemm`, `lowbit audit kernels --weights`.
set -u
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s INT ${E2E_S:-100} python3 -m lowbit bench decode --batch 1,16 --length 32k --paths lowbit-int2,lowbit-w4a16-int2 --steps 20 --out "$OUT/decode_e2e.json" > "$OUT/decode_e2e.log" 2>&1; echo "e2e rc $?"
grep -E "ms/step|weights " "$OUT/decode_e2e.log" | tail -6
timeout -s INT ${BENCH_S:-110} python3 -m lowbit bench gemm --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; echo "bench rc $?"
grep -E "M=(1|16|4096) " "$OUT/gemm.log" | grep -E "gate/up" | head -20
timeout -s INT ${AUDIT_S:-90} python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights.json" > "$OUT/audit_weights.log" 2>&1; echo "audit rc $?"
tail -5 "$OUT/audit_weights.log"
