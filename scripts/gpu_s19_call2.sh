#!/usr/bin/env bash
# One device call (issue 16, H200, ~8 min): `lowbit bench decode` at L 32k, B 1 / 16 / 64, the schema's paths but
# lowbit-int4 (not in a target; time), one run, the lowbit rows compiled per decoder layer (--compile layers: ~45 s a
# row; the one-graph default takes ~115 s a row and the sweep would not fit one call): the decode_e2e file the issue
# names. Call 1 (scripts/gpu_s19_call1.sh) timed the one-graph step at B1 in its own run.
# Usage: scripts/gpu_s19_call2.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 570 python3 -m lowbit bench decode --batch 1,16,64 --length 32k --steps 20 --compile layers \
    --paths hf-eager-bf16,hf-static-compile-bf16,lowbit-bf16,lowbit-int2,lowbit-w4a16-int2 \
    --out "$OUT/decode_e2e_NVIDIA_H200.json" > "$OUT/decode_e2e_NVIDIA_H200.log" 2>&1
echo "bench rc $? $(el)"; grep -E "ms/step|does not fit|^weights" "$OUT/decode_e2e_NVIDIA_H200.log"
python3 - "$OUT/decode_e2e_NVIDIA_H200.json" <<'P' 2>/dev/null
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if r.get("compiled"): print(r["path"], r["B"], "compile_s", r["ran"]["compile_s"], "graphs", r["ran"]["unique_graphs"])
P
