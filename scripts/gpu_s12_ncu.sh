#!/usr/bin/env bash
# One device call (issue 17, H200, ~3 min): Nsight Compute on the small-M CUDA kernel above M 16 (M 32 / 64,
# gate/up), with the warp stall reasons, to see what holds the M 17-64 cells under bf16.
# Usage: scripts/gpu_s12_ncu.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 scripts/place_cuda_lib.py
for c in "w4a16-g128 14336 4096 64 cuda-rt1-w4-sk0" "w4a16-g128 14336 4096 64 cuda-rt1-w8-sk0" \
         "w4a16-g128 14336 4096 32 cuda-rt1-w8-sk0" "w4a16-g128 14336 4096 16 cuda-rt1-w8-sk0"; do
  echo "=== $c"
  timeout 90 ncu --clock-control none -k regex:wq_small_m --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --metrics smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__inst_executed.sum,smsp__average_warp_latency_issue_stalled_barrier.ratio \
      python3 benchmarks/weight_ncu_probe.py $c 2>&1 | grep -vE "^==PROF==|^\s*$" | head -160
done > "$OUT/ncu.txt" 2>&1
grep -E "===|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per|Warp Cycles Per Issued|stalled|inst_executed|Issue Slots Busy|Block Limit" "$OUT/ncu.txt" | head -120
