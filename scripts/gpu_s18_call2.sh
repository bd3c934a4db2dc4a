#!/usr/bin/env bash
# One device call (issues 19 and 17, H200, ~8 min): (1) `lowbit bench decode-attention --geometry` on the three
# geometries of issue 19 (and the tp8 latent) with today's defaults, one run, the file the issue names; (2) W8A8's
# int8 kernel re-timed after its weight tile went straight into the dot (`gemm_explore.py --a8-retime`).
# Usage: scripts/gpu_s18_call2.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
timeout -s INT 270 python3 -m lowbit bench decode-attention \
    --geometry deepseek-v3-latent,kimi-k192v128,gemma4-full512,deepseek-v3-latent-tp8 --batch 1,16 --length 32768 \
    --bits 2 --out "$OUT/decode_attention_geometry_NVIDIA_H200.json" > "$OUT/decode_attention_geometry_NVIDIA_H200.log" 2>&1
echo "bench rc $? $(el)"; grep -vE "^\s*$" "$OUT/decode_attention_geometry_NVIDIA_H200.log" | tail -12
timeout -s INT 300 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_a8_retime.json" --a8-retime \
    > "$OUT/gemm_explore_a8_retime.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^a8-retime" "$OUT/gemm_explore_a8_retime.log" | grep -E "M=(256|1024|4096) " | head -24
