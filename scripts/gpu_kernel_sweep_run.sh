#!/usr/bin/env bash
# One device call (issue 16, H200, ~4 min): the fused decode kernel's launch sweep inside the runtime's cache
# (benchmarks/kernel_in_step_probe.py --sweep) at B 16 and 1, L 32k, int2; then the runtime GPU tests.
# Usage: scripts/gpu_kernel_sweep_run.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
for b in 16 1; do
  timeout -s INT ${SWEEP_S:-110} python3 benchmarks/kernel_in_step_probe.py --batch $b --sweep --out "$OUT/sweep_B$b.json" \
      > "$OUT/sweep_B$b.log" 2>&1; echo "sweep B$b rc $?"; grep -v Warn "$OUT/sweep_B$b.log" | sort -k5 -n | head -8; grep best "$OUT/sweep_B$b.log"
done
timeout -s INT ${TESTS_S:-120} python3 -m pytest -rA --tb=short -p no:cacheprovider -m gpu \
    tests/runtime/test_gpu_runtime.py tests/runtime/test_generate.py > "$OUT/tests.log" 2>&1
echo "tests rc $?"; grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/tests.log" | tail -14
