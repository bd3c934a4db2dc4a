#!/usr/bin/env bash
# One device call (issues 16/17, H200, ~10 min): `lowbit bench gemm` with the s15 table (the two-tile warp-split cells
# at M 9-16), then end to end at B=16, L=32k, random-weight Llama-3-8B geometry, one process: transformers eager bf16,
# lowbit's runtime at bf16 (captured), lowbit int2 and W4A16 g128 + int2 through the compiled, captured step.
# Usage: scripts/gpu_s15_call2.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 170 python3 -m lowbit bench gemm --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; echo "bench rc $? $(el)"
grep -E "^(w4a16-g128) .*M=(1|8|16) " "$OUT/gemm.log" | cut -c1-120 | head -24
timeout -s INT 400 python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10 --batch 16 \
    --paths hf-eager-bf16,lowbit-bf16,lowbit-int2-compiled,lowbit-w4a16-int2-compiled --out "$OUT/decode_e2e_B16.json" \
    > "$OUT/e2e_B16.log" 2>&1
echo "e2e rc $? $(el)"; grep -E "ms/step|wq_|busy" "$OUT/e2e_B16.log" | head -24; tail -3 "$OUT/e2e_B16.log"
