#!/usr/bin/env bash
# s23 call 7 (H200; carry .gpu/cuda): the committed dispatch table (call 6's tiled v2 cells, and the bench-row shape
# cells of s21's and call 6's runs) through the audit and `lowbit bench gemm`: the canonical results.
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 170 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights_NVIDIA_H200.json" \
    > "$OUT/audit_weights_s23_final_NVIDIA_H200.log" 2>&1; echo "audit rc $? $(el)"; tail -3 "$OUT/audit_weights_s23_final_NVIDIA_H200.log"
timeout -s INT 200 python3 -m lowbit bench gemm --out "$OUT/gemm_NVIDIA_H200.json" > "$OUT/gemm_NVIDIA_H200.log" 2>&1
echo "bench gemm rc $? $(el)"; grep -E "w4a16-g128 +(llama3-8b (gate/up|down|qkv/o)|smollm2 down) +M=(1|16|17|32|64|128) " "$OUT/gemm_NVIDIA_H200.log" | head -24
