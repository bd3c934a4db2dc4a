#!/usr/bin/env bash
# One device call (issues 16/17, H200, ~4 min): the W4A16 + int2 B=1 L=32k compiled step's kernel timeline (kernels
# per step, busy vs span, idle between kernels, the largest gaps): benchmarks/step_timeline.py.
# Usage: scripts/gpu_s14_timeline.sh "$OUT" [--inductor-pdl]
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"; shift || true
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 scripts/place_cuda_lib.py
# (the Inductor-PDL run: the same with --inductor-pdl, results step_timeline_w4a16_B1_inductor_pdl_s14_*)
timeout -s INT 300 python3 benchmarks/step_timeline.py "$OUT/step_timeline_w4a16_B1.json" "$@" > "$OUT/step_timeline.log" 2>&1
echo "timeline rc $?"; grep -vE "^\s+[0-9.]+ ms  x" "$OUT/step_timeline.log" | tail -20
