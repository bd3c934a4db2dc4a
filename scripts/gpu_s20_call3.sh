#!/usr/bin/env bash
# One device call (issues 16 and 17, H200, ~7 min): why W4A16 weights save 1.0 ms of GEMM time at B16 L32k (call 2: the
# warp-split kernels 2.98 ms vs cuBLAS 4.02 ms) but only 0.15 ms of the step (8.94 vs 9.09 ms): the profiler's kernel
# timeline of both one-graph compiled steps, one process (benchmarks/step_timeline.py, with one replay's kernels in order).
# Usage: scripts/gpu_s20_call3.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 500 python3 benchmarks/step_timeline.py "$OUT/step_timeline_B16_s20_NVIDIA_H200.json" --batch 16 \
    --path lowbit-int2,lowbit-w4a16-int2 --compile whole > "$OUT/step_timeline_B16_s20_NVIDIA_H200.log" 2>&1
echo "timeline rc $? $(el)"; grep -vE "^\s+[0-9.]+ ms  x|[Ww]arn" "$OUT/step_timeline_B16_s20_NVIDIA_H200.log" | tail -30
