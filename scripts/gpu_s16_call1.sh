#!/usr/bin/env bash
# Issue 19, s16 call 1 (MLA latent):
#   1. benchmarks/latent_proto_bench.py (removed after this run; and the ncu case, at commit 48452b3): lowbit.kernels.decode_latent (one dequantization per tile, both products
#      on warpgroup MMAs) checked against the twin at odd sizes, then timed beside the geometry kernel and the bf16
#      torch form at tp8 (16 heads) and 128 heads, B 16 / 1, L 32k.
#   2. the geometry kernel's latent configs that compile without spills (benchmarks/compile_geo_sm90.py: the
#      resolved default uses 255 registers and spills 440-552 B a thread at tp8; 8 heads a program does not spill).
# Usage: bash scripts/gpu_s16_call1.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
P=()
for c in "heads=16,block_t=64,num_warps=4" "heads=16,block_t=64,num_warps=8" "heads=16,block_t=128,num_warps=8" \
         "heads=16,block_t=64,num_warps=4,pv_acc=1" "heads=16,block_t=64,num_warps=8,pv_acc=1" "heads=16,block_t=64,num_warps=4,num_stages=1,pv_acc=1"; do P+=(--cfg "$c"); done
timeout -s INT 210 python3 benchmarks/latent_proto_bench.py --out "$OUT/latent_proto.json" "${P[@]}" \
    > "$OUT/latent_proto.log" 2>&1
echo "proto rc $?"; grep -E "CHECK|ROW|new|failed|Error" "$OUT/latent_proto.log" | cut -c1-400 | tail -n 40
C=()
for c in "block_t=64,heads=16,num_warps=4" \
         "block_t=64,heads=8,num_warps=4,q_loop=0" "block_t=32,heads=8,num_warps=4,q_loop=0" \
         "block_t=64,heads=8,num_warps=8,q_loop=0" "block_t=128,heads=8,num_warps=8,q_loop=0" \
         "block_t=64,heads=8,num_warps=4,q_loop=0,zero_mma=0" "block_t=32,heads=16,num_warps=8,q_loop=0"; do C+=(--cfg "$c"); done
timeout -s INT 130 python3 -m lowbit.kernels.geo_bench --sweep "$OUT/sweep_tp8.json" \
    --geometry deepseek-v3-latent-tp8 --batch 16,1 --length 32768 --bits 2 "${C[@]}" > "$OUT/sweep_tp8.log" 2>&1
echo "tp8 rc $?"; grep -E "^SWEEP |config" "$OUT/sweep_tp8.log" | cut -c1-300 | tail -n 30
# 3. Nsight Compute: the geometry kernel's default and the new kernel at tp8 B16 L32k
for c in "geo 16 16" "new 16 16 {\"heads\":16,\"block_t\":64,\"num_warps\":4}" "new 16 16 {\"heads\":16,\"block_t\":64,\"num_warps\":4,\"pv_acc\":1}"; do
  echo "=== $c"
  timeout 70 ncu --clock-control none -k 'regex:_geo_stage1|_lat_stage1' --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --metrics smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__inst_executed.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,smsp__pcsamp_warps_issue_stalled_long_scoreboard \
      python3 benchmarks/latent_ncu_case.py $c 2>&1 | grep -vE "^==PROF==|^\s*$" | head -170
done > "$OUT/ncu_latent.txt" 2>&1
grep -E "===|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|stalled|inst_executed|local_op|Issue Slots Busy|Block Limit|Shared Memory Configuration|L1/TEX Hit" "$OUT/ncu_latent.txt" | head -120
