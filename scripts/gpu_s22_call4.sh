#!/usr/bin/env bash
# Call 4 (issue 19, H200): the latent kernel's scores by wgmma (impl="cuda-wgmma": q^T through a descriptor once per
# warpgroup, codes as the register operand) beside the mma.sync instances: GPU tests, then the latent rows of
# `lowbit bench decode-attention` (all candidates).
# Usage: scripts/gpu_s22_call4.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
timeout -s INT 150 python3 -m pytest -q -m gpu tests/kernels/test_latent_cuda.py > "$OUT/gpu_tests_latent_wgmma.log" 2>&1
echo "tests rc $? $(el)"; tail -4 "$OUT/gpu_tests_latent_wgmma.log"
timeout -s INT 260 python3 -m lowbit bench decode-attention --geometry deepseek-v3-latent-tp8,deepseek-v3-latent \
    --batch 1,16 --length 32768 --bits 2 --out "$OUT/decode_attention_latent_wgmma.json" > "$OUT/decode_attention_latent_wgmma.log" 2>&1
echo "bench rc $? $(el)"; grep -E "^deepseek|impl='cuda" "$OUT/decode_attention_latent_wgmma.log" | sed -E "s/(block_t|heads|num_splits|num_stages|dense_block|q_loop|zero_mma)=None, //g"
