#!/usr/bin/env bash
# One device call (issue 16, H200, ~9.5 min): (1) `lowbit bench decode` at L 32k, B 1 / 16 / 64, every schema path, the
# lowbit rows compiled per decoder layer (the new default, --compile layers), one run: the decode_e2e file the issue
# names; (2) B1 int2 with the step compiled as one graph (--compile whole), against (1)'s row; (3) the compiled-step
# GPU tests for the per-layer regions and the whole graph.
# Usage: scripts/gpu_s19_call1.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 330 python3 -m lowbit bench decode --batch 1,16,64 --length 32k --steps 20 \
    --paths hf-eager-bf16,hf-static-compile-bf16,lowbit-bf16,lowbit-int4,lowbit-int2,lowbit-w4a16-int2 \
    --out "$OUT/decode_e2e_NVIDIA_H200.json" > "$OUT/decode_e2e_NVIDIA_H200.log" 2>&1
echo "bench rc $? $(el)"; grep -E "ms/step|does not fit" "$OUT/decode_e2e_NVIDIA_H200.log"
python3 - "$OUT/decode_e2e_NVIDIA_H200.json" <<'P' 2>/dev/null
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if r.get("compiled"): print(r["path"], r["B"], "compile_s", r["ran"]["compile_s"], "graphs", r["ran"]["unique_graphs"])
P
timeout -s INT 150 python3 -m lowbit bench decode --batch 1 --length 32k --steps 20 --paths lowbit-int2 --compile whole \
    --out "$OUT/decode_e2e_B1_whole_s19_NVIDIA_H200.json" > "$OUT/decode_e2e_B1_whole_s19_NVIDIA_H200.log" 2>&1
echo "whole rc $? $(el)"; grep -E "ms/step" "$OUT/decode_e2e_B1_whole_s19_NVIDIA_H200.log"
timeout -s INT 110 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_gpu_compiled.py \
    -k "int2] or whole or recompile" > "$OUT/gpu_tests_compiled_regions_s19_NVIDIA_H200.log" 2>&1
echo "tests rc $? $(el)"; tail -3 "$OUT/gpu_tests_compiled_regions_s19_NVIDIA_H200.log"
