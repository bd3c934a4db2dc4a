#!/usr/bin/env bash
# One device call (issue 16, H200, <= 9.5 min): the runtime with fused q/k/v and gate/up GEMMs (lowbit.runtime.fuse),
# eager-captured and compiled-captured, B 1 and 16 at L 32k; the in-step kernel probe (benchmarks/kernel_in_step_probe.py);
# the runtime's GPU tests; the same rows unfused (--no-fuse) for the same-run comparison.
# Usage: scripts/gpu_runtime_fused_run.sh "$OUT"   (at most 7 files land in $OUT)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
B="python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10"
timeout -s INT ${FUSED_S:-250} $B --batch 1,16 --paths lowbit-int2,lowbit-int2-compiled --out "$OUT/e2e_fused.json" \
    > "$OUT/e2e.log" 2>&1; echo "fused rc $?"
grep -E "ms/step" "$OUT/e2e.log"
timeout -s INT ${PROBE_S:-80} python3 benchmarks/kernel_in_step_probe.py --batch 16 --out "$OUT/probe_B16.json" \
    > "$OUT/probe.log" 2>&1; echo "probe rc $?"; cat "$OUT/probe.log" | grep -v Warn | tail -16
timeout -s INT ${TESTS_S:-110} python3 -m pytest -rA --tb=long -p no:cacheprovider -m gpu \
    tests/runtime/test_gpu_runtime.py tests/runtime/test_generate.py > "$OUT/tests.log" 2>&1; echo "tests rc $?"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E  |passed|failed" "$OUT/tests.log" | tail -14
timeout -s INT ${NOFUSE_S:-75} $B --batch 1,16 --paths lowbit-int2 --no-fuse --out "$OUT/e2e_nofuse.json" \
    >> "$OUT/e2e.log" 2>&1; echo "nofuse rc $?"
grep -E "ms/step" "$OUT/e2e.log" | tail -2
timeout -s INT ${PROBE1_S:-45} python3 benchmarks/kernel_in_step_probe.py --batch 1 --out "$OUT/probe_B1.json" \
    >> "$OUT/probe.log" 2>&1; echo "probe1 rc $?"; grep -v Warn "$OUT/probe.log" | tail -14
