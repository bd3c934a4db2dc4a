#!/usr/bin/env bash
# One device call (issue 16, H200, ~7 min): B=64, L=32k end to end after the rotation rule change (a traced
# rotation is a GEMM above 64 rows), random-weight Llama-3-8B geometry: lowbit int2 and W4A16 g128 + int2 through
# the compiled, captured step (Inductor PDL by default).
# Usage: scripts/gpu_s16_call3.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 420 python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10 --batch 64 \
    --paths lowbit-int2-compiled,lowbit-w4a16-int2-compiled --out "$OUT/decode_e2e_B64.json" > "$OUT/e2e_B64.log" 2>&1
echo "e2e rc $? $(el)"; grep -E "ms/step|_stage1|nvjet|wq_|busy|fit" "$OUT/e2e_B64.log" | head -30; tail -3 "$OUT/e2e_B64.log"
