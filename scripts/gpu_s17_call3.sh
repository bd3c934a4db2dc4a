#!/usr/bin/env bash
# One device call (issue 17, H200, ~4 min): the CUDA weight kernels after the two launch fixes (48 KB opt-in with the
# kernels' static shared memory; a failed PDL launch's error cleared): their GPU tests, then `lowbit audit kernels
# --weights` with the committed table.
# Usage: scripts/gpu_s17_call3.sh "$OUT"      (carry .gpu/cuda: the library built on the CPU host)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 200 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_cuda.py \
    > "$OUT/gpu_tests_weight_cuda.log" 2>&1; echo "tests rc $? $(el)"
grep -E "FAILED|^E  |passed|failed" "$OUT/gpu_tests_weight_cuda.log" | head -20
timeout -s INT 240 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights.json" > "$OUT/audit_weights.log" 2>&1
echo "audit rc $? $(el)"; tail -5 "$OUT/audit_weights.log"
