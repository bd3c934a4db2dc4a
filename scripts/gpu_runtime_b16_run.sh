#!/usr/bin/env bash
# One device call (issue 16, H200, ~7 min): the runtime (fused projections, the "many_lowbit" kernel regime with dense programs in the waves) at
# B16 eager-captured and compiled-captured, B64 eager-captured, L 32k int2; then the runtime GPU tests.
# Usage: scripts/gpu_runtime_b16_run.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
B="python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10"
timeout -s INT ${B16_S:-230} $B --batch 16 --paths lowbit-int2,lowbit-int2-compiled --out "$OUT/e2e_B16.json" \
    > "$OUT/e2e.log" 2>&1; echo "B16 rc $?"; grep -E "ms/step" "$OUT/e2e.log"
timeout -s INT ${B64_S:-90} $B --batch 64 --paths lowbit-int2 --out "$OUT/e2e_B64.json" >> "$OUT/e2e.log" 2>&1
echo "B64 rc $?"; grep -E "ms/step" "$OUT/e2e.log" | tail -1
timeout -s INT ${TESTS_S:-80} python3 -m pytest -rA --tb=short -p no:cacheprovider -m gpu \
    tests/runtime/test_gpu_runtime.py tests/runtime/test_generate.py > "$OUT/tests.log" 2>&1
echo "tests rc $?"; grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/tests.log" | tail -10
