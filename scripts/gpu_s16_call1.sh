#!/usr/bin/env bash
# Issue 19, s16 call 1: MLA latent launch configs that do not spill (benchmarks/compile_geo_sm90.py on CPU:
# the resolved default for the tp8 latent uses 255 registers and spills 440-552 B a thread; 8 heads a program
# with q in registers compiles without spills). Times them against the defaults (CUDA graph, rotating inputs).
# Usage: bash scripts/gpu_s16_call1.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
C=()
for c in "block_t=64,heads=16,num_warps=4" \
         "block_t=64,heads=8,num_warps=4,q_loop=0" "block_t=32,heads=8,num_warps=4,q_loop=0" \
         "block_t=64,heads=8,num_warps=8,q_loop=0" "block_t=128,heads=8,num_warps=8,q_loop=0" \
         "block_t=32,heads=8,num_warps=2,q_loop=0" "block_t=64,heads=8,num_warps=4,q_loop=0,zero_mma=0" \
         "block_t=32,heads=16,num_warps=8,q_loop=0"; do C+=(--cfg "$c"); done
timeout -s INT 330 python3 -m lowbit.kernels.geo_bench --sweep "$OUT/sweep_tp8.json" \
    --geometry deepseek-v3-latent-tp8 --batch 16,1 --length 32768 --bits 2 "${C[@]}" > "$OUT/sweep_tp8.log" 2>&1
echo "tp8 rc $?"; grep -E "^SWEEP |config" "$OUT/sweep_tp8.log" | tail -n 40
C2=()
for c in "block_t=32,heads=32,num_warps=4" "block_t=64,heads=8,num_warps=4,q_loop=0" \
         "block_t=128,heads=8,num_warps=8,q_loop=0" "block_t=64,heads=16,num_warps=8,q_loop=0"; do C2+=(--cfg "$c"); done
timeout -s INT 150 python3 -m lowbit.kernels.geo_bench --sweep "$OUT/sweep_128.json" \
    --geometry deepseek-v3-latent --batch 16 --length 32768 --bits 2 "${C2[@]}" > "$OUT/sweep_128.log" 2>&1
echo "128 rc $?"; grep -E "^SWEEP |config" "$OUT/sweep_128.log" | tail -n 20
