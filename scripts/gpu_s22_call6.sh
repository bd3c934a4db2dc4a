#!/usr/bin/env bash
# s22 call 6 (issue 19, H200): a third latent instance (4 warps, 2 stages, 3 blocks a SM, 168 registers, values
# accumulated into O) and whole-wave split counts for the CUDA middle: its GPU tests, then the latent rows of
# `lowbit bench decode-attention` (all candidates).
# Usage: scripts/gpu_s22_call6.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
timeout -s INT 120 python3 -m pytest -q -m gpu tests/kernels/test_latent_cuda.py > "$OUT/gpu_tests_latent_cuda_s22_call6.log" 2>&1
echo "tests rc $? $(el)"; tail -3 "$OUT/gpu_tests_latent_cuda_s22_call6.log"
timeout -s INT 200 python3 -m lowbit bench decode-attention --geometry deepseek-v3-latent-tp8,deepseek-v3-latent \
    --batch 1,16 --length 32768 --bits 2 --out "$OUT/decode_attention_latent_s22_call6.json" > "$OUT/decode_attention_latent_s22_call6.log" 2>&1
echo "bench rc $? $(el)"; grep -E "^deepseek|impl='cuda" "$OUT/decode_attention_latent_s22_call6.log" | sed -E "s/(block_t|heads|num_splits|dense_block|q_loop|zero_mma)=None, //g"
