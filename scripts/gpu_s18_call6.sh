#!/usr/bin/env bash
# One device call (issue 17, H200, ~3 min): the A8 GPU tests, then `lowbit bench gemm` (run as call 6 with one-pass rows up to
# K 16384, and as call 7 with one-pass rows up to K 8192; call 5 had refused the early `return` of the first version).
# Usage: scripts/gpu_s18_call6.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 120 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_gemm.py \
    -k "a8_activation or tma" > "$OUT/gpu_tests_a8_rows.log" 2>&1; echo "tests rc $? $(el)"
grep -E "FAILED|^E  |passed|failed" "$OUT/gpu_tests_a8_rows.log" | head -10
timeout -s INT 150 python3 -m lowbit bench gemm --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; echo "bench gemm rc $? $(el)"
grep -E "^w8a8 .*M=(4096|1024) " "$OUT/gemm.log" | head -12
