#!/usr/bin/env bash
# One device call (issue 19, H200, ~5 min): the MLA latent kernel's launch configs by batch, for a batch-aware default
# (GeoConfig.resolve): DeepSeek-V3 latent at 128 heads and at tp8 (16), B 1 / 4 / 16, L32k, int2 and the bf16
# dense-middle path, eight configs each (python -m lowbit.kernels.geo_bench --sweep --cfg ...).
# Usage: scripts/gpu_s17_call4.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
C=""
for c in heads=16,block_t=64,num_warps=4 heads=32,block_t=32,num_warps=4 heads=8,block_t=64,num_warps=4,q_loop=0 \
         heads=8,block_t=128,num_warps=8,q_loop=0 heads=16,block_t=128,num_warps=8 heads=32,block_t=64,num_warps=8 \
         heads=16,block_t=32,num_warps=4 heads=8,block_t=128,num_warps=4,q_loop=0; do C="$C --cfg $c"; done
timeout -s INT 420 python3 -m lowbit.kernels.geo_bench --sweep "$OUT/geo_sweep_latent_by_batch.json" \
    --geometry deepseek-v3-latent-tp8,deepseek-v3-latent --batch 1,4,16 --bits 2 $C > "$OUT/geo_sweep_latent_by_batch.log" 2>&1
echo "sweep rc $? $(el)"; grep -E "^SWEEP " "$OUT/geo_sweep_latent_by_batch.log"
