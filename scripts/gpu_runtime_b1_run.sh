#!/usr/bin/env bash
# One device call (issue 16, H200, <= 6 min): B1 L32k in one run -- transformers' StaticCache + torch.compile bf16
# baseline beside lowbit int2 compiled-captured (fused projections, V's rotation folded, the few-pairs kernel
# regime); then the runtime GPU tests for the fold and the captured step.
# Usage: scripts/gpu_runtime_b1_run.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
timeout -s INT ${TESTS_S:-90} python3 -m pytest -rA --tb=short -p no:cacheprovider -m gpu tests/runtime/test_gpu_runtime.py \
    -k "fused_projections or captured_step_equals" > "$OUT/tests.log" 2>&1; echo "tests rc $?"
grep -E "^(PASSED|FAILED|ERROR)|^E  |passed|failed" "$OUT/tests.log" | tail -10
timeout -s INT ${B1_S:-300} python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10 --batch 1 \
    --paths lowbit-int2-compiled,hf-static-compile-bf16,lowbit-int2 --out "$OUT/e2e_B1.json" > "$OUT/e2e.log" 2>&1
echo "B1 rc $?"; grep -E "ms/step" "$OUT/e2e.log"
