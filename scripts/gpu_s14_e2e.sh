#!/usr/bin/env bash
# One device call (issues 16/17, H200, ~9 min): end to end, random-weight Llama-3-8B geometry, B=1, L=32k: transformers'
# StaticCache + torch.compile bf16 path beside lowbit W4A16 g128 + int2 KV through the compiled, captured step (the
# dispatch table with the warp-split CUDA cells), one process.
# Usage: scripts/gpu_s14_e2e.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 540 python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10 --batch 1 \
    --paths hf-static-compile-bf16,lowbit-w4a16-int2-compiled --out "$OUT/decode_e2e_w4a16_B1.json" > "$OUT/e2e.log" 2>&1
echo "e2e rc $? $(el)"; grep -E "ms/step|wq_|top|busy" "$OUT/e2e.log" | head -20; tail -5 "$OUT/e2e.log"
