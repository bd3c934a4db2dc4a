#!/usr/bin/env bash
# s23 call 4 (H200; carry .gpu/cuda): Nsight Compute on the tiled 4-bit kernel (gate/up 14336 x 4096 at M 17 / 64 / 128):
# calls 1-3 put it at ~0.16 mma a cycle per SM at M 128 and ~0.9 TB/s of weight at M 17, bound by neither the
# copies' L2 prefetch nor the DRAM pattern. Which stall holds it?
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 scripts/place_cuda_lib.py
for c in "w4a16-g128 14336 4096 17 cuda-tl-wn8-wm1-rt1-mt4-s4-sk0-pdl" "w4a16-g128 14336 4096 64 cuda-tl-wn8-wm1-rt1-mt4-s4-sk0-pdl" \
         "w4a16-g128 14336 4096 128 cuda-tl-wn4-wm2-rt2-mt4-s3-sk0-pdl"; do
  echo "=== $c"
  timeout 100 ncu --clock-control none -k regex:wq_tiled --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \
      --metrics smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_tex_throttle,smsp__pcsamp_warps_issue_stalled_imc_miss,smsp__pcsamp_warps_issue_stalled_no_instructions,smsp__pcsamp_warps_issue_stalled_branch_resolving,smsp__pcsamp_warps_issue_stalled_drain,smsp__pcsamp_warps_issue_stalled_membar,smsp__pcsamp_warps_issue_stalled_sleeping,smsp__inst_executed.sum,sm__inst_executed_pipe_tensor_op_hmma.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__sass_inst_executed_op_shared_ld.sum,smsp__sass_inst_executed_op_ldgsts.sum \
      python3 benchmarks/weight_ncu_probe.py $c 2>&1 | grep -vE "^==PROF==|^\s*$" | head -200
done > "$OUT/ncu_tiled_s23_NVIDIA_H200.txt" 2>&1
grep -E "===|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per|Warp Cycles Per Issued|stalled|inst_executed|hmma|bank_conflicts|wavefronts|Issue Slots Busy|Block Limit|ldgsts|shared_ld|Executed Ipc" "$OUT/ncu_tiled_s23_NVIDIA_H200.txt" | head -150
