#!/usr/bin/env bash
# One device call (issue 17, H200, ~6 min) with the committed table (17-32 / 33-64 buckets): `lowbit bench gemm`
# (the issue's full sweep, benchmarks/results/gemm_<gpu>.json), `lowbit audit kernels --weights`, and the
# W4A16 + int2 compiled decode row at B1 / L32k beside int2 with bf16 weights.
# Usage: scripts/gpu_s12_call2.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 150 python3 -m lowbit bench gemm --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; echo "bench rc $? $(el)"
grep -E "M=(1|16|32|64|4096) " "$OUT/gemm.log" | grep -E "gate/up" | cut -c1-110 | head -30
timeout -s INT 150 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights.json" > "$OUT/audit_weights.log" 2>&1
echo "audit rc $? $(el)"; tail -5 "$OUT/audit_weights.log"
timeout -s INT 200 python3 -m lowbit bench decode --geometry llama3-8b --batch 1 --length 32k --steps 10 \
    --paths lowbit-int2-compiled,lowbit-w4a16-int2-compiled --out "$OUT/decode_e2e_w4_B1.json" > "$OUT/decode_e2e_w4_B1.log" 2>&1
echo "e2e rc $? $(el)"; grep -E "ms/step|weights " "$OUT/decode_e2e_w4_B1.log" | tail -6
