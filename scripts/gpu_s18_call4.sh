#!/usr/bin/env bash
# One device call (issue 17, H200, ~6 min) with the s18 table (W8A8 TMA cells): `lowbit audit kernels --weights`
# (every claimed cell against its twin), then `lowbit bench gemm` (the committed gemm_<gpu>.json).
# Usage: scripts/gpu_s18_call4.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 240 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights.json" > "$OUT/audit_weights.log" 2>&1
echo "audit rc $? $(el)"; tail -4 "$OUT/audit_weights.log"
timeout -s INT 200 python3 -m lowbit bench gemm --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; echo "bench rc $? $(el)"
grep -E "^w8a8 .*(M=4096|M=1024) " "$OUT/gemm.log" | head -12; tail -2 "$OUT/gemm.log"
