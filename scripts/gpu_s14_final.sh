#!/usr/bin/env bash
# One device call (issue 17, H200, ~7 min): after the clean-up (one Params builder for both CUDA entry points, the
# Triton kernels' shared dequantize helpers): every gpu-marked weight-kernel test, then the audit with the table.
# Usage: scripts/gpu_s14_final.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 240 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_cuda.py \
    tests/kernels/test_weight_gemm.py > "$OUT/gpu_tests_weights.log" 2>&1
echo "tests rc $? $(el)"; grep -E "^FAILED|^E  |passed|failed" "$OUT/gpu_tests_weights.log" | head -12
timeout -s INT 150 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights.json" > "$OUT/audit_weights.log" 2>&1
echo "audit rc $? $(el)"; tail -4 "$OUT/audit_weights.log"
