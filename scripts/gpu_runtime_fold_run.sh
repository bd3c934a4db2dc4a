#!/usr/bin/env bash
# One device call (issue 16, H200, <= 9.5 min): the runtime with V's rotation folded into v_proj / o_proj
# (lowbit.runtime.fold) and traced rotations as fused product-sums, eager-captured and compiled, B 1 and 16 at
# L 32k; the same eager rows with --no-fold; the kernel's split rule checked at B1 L 4k / 128k
# (benchmarks/kernel_in_step_probe.py --sweep); the runtime's GPU tests.
# Usage: scripts/gpu_runtime_fold_run.sh "$OUT"   (at most 7 files land in $OUT)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
B="python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10"
timeout -s INT ${FOLD_S:-260} $B --batch 1,16 --paths lowbit-int2,lowbit-int2-compiled --out "$OUT/e2e_fold.json" \
    > "$OUT/e2e.log" 2>&1; echo "fold rc $?"
grep -E "ms/step" "$OUT/e2e.log"
timeout -s INT ${NOFOLD_S:-70} $B --batch 1,16 --paths lowbit-int2 --no-fold --out "$OUT/e2e_nofold.json" \
    >> "$OUT/e2e.log" 2>&1; echo "nofold rc $?"
grep -E "ms/step" "$OUT/e2e.log" | tail -2
timeout -s INT ${TESTS_S:-120} python3 -m pytest -rA --tb=long -p no:cacheprovider -m gpu \
    tests/runtime/test_gpu_runtime.py tests/runtime/test_generate.py > "$OUT/tests.log" 2>&1; echo "tests rc $?"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E  |passed|failed" "$OUT/tests.log" | tail -16
for L in 4096 131072; do
  timeout -s INT ${SWEEP_S:-45} python3 benchmarks/kernel_in_step_probe.py --batch 1 --length $L --sweep \
      --out "$OUT/sweep_B1_L$L.json" > "$OUT/sweep_B1_L$L.log" 2>&1; echo "sweep B1 L$L rc $?"
  grep -E "launch=" "$OUT/sweep_B1_L$L.log" | cut -c1-300; grep -v Warn "$OUT/sweep_B1_L$L.log" | grep "us/call" | sort -k5 -n | head -5
  grep "sauto" "$OUT/sweep_B1_L$L.log" | head -4
done
