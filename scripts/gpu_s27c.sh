#!/usr/bin/env bash
# s27 third device call (H200; carry .gpu/cuda): issue 17, the table with s27's W8A16 M=1 GEMV shape cells
# (benchmarks/results/weights/s27/gemm_explore_gemv_tiles_s27_NVIDIA_H200.json): the W8A16 weight audit over its whole
# sweep, then the canonical `lowbit bench gemm` with the read floor.
# Usage: scripts/gpu_s27c.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py > /dev/null
timeout -s INT 150 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights_s27_NVIDIA_H200.json" \
    > "$OUT/audit_weights_s27_NVIDIA_H200.log" 2>&1; echo "audit rc $? $(el)"; tail -3 "$OUT/audit_weights_s27_NVIDIA_H200.log"
timeout -s INT 300 python3 -m lowbit bench gemm --read-floor --out "$OUT/gemm_NVIDIA_H200.json" > "$OUT/gemm_NVIDIA_H200.log" 2>&1
echo "bench gemm rc $? $(el)"; grep -E "^w8a16 +llama3-8b (gate/up|down|qkv/o) +M=1 " "$OUT/gemm_NVIDIA_H200.log"
