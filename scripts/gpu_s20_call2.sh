#!/usr/bin/env bash
# One device call (issues 17 and 16, H200, ~8 min) with the sm90 table rebuilt from call 1 (the launch-bound-256 cells at
# M 9-16): `lowbit audit kernels --weights`, `lowbit bench gemm`, then B16 L32k int2 with bf16 weights and with W4A16
# weights through the one-graph compiled step, one run.
# Usage: scripts/gpu_s20_call2.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 120 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights_s20_NVIDIA_H200.json" \
    > "$OUT/audit_weights_s20_NVIDIA_H200.log" 2>&1; echo "audit rc $? $(el)"; tail -3 "$OUT/audit_weights_s20_NVIDIA_H200.log"
timeout -s INT 110 python3 -m lowbit bench gemm --out "$OUT/gemm_NVIDIA_H200.json" > "$OUT/gemm_NVIDIA_H200.log" 2>&1
echo "bench gemm rc $? $(el)"; grep -E "^w4a16.* M=(1|16) " "$OUT/gemm_NVIDIA_H200.log" | head -16
timeout -s INT 380 python3 -m lowbit bench decode --batch 16 --length 32k --steps 20 --compile whole \
    --paths lowbit-int2,lowbit-w4a16-int2 --out "$OUT/decode_e2e_B16_w4_whole_s20_NVIDIA_H200.json" \
    > "$OUT/decode_e2e_B16_w4_whole_s20_NVIDIA_H200.log" 2>&1
echo "e2e rc $? $(el)"; grep -E "ms/step|^ +[0-9.]+ ms +x" "$OUT/decode_e2e_B16_w4_whole_s20_NVIDIA_H200.log" | head -40
