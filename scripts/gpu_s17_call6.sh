#!/usr/bin/env bash
# One device call (issue 17, H200, ~3 min): Nsight Compute on the warp-split W4A16 kernel at M = 1 and M = 16 (gate/up,
# the tabled launch), with the warp stall reasons: what the M = 16 cell (1.2x bf16, half the M = 1 speed on the same
# bytes) waits on, after the shared-memory ring did not help (NOTES round 13).
# Usage: scripts/gpu_s17_call6.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 scripts/place_cuda_lib.py
for c in "w4a16-g128 14336 4096 1 cuda-ws-rt2-w4-nb3-sk0" "w4a16-g128 14336 4096 16 cuda-ws-rt2-w4-nb3-sk0"; do
  echo "=== $c"
  timeout 100 ncu --clock-control none -k regex:wq_warp_split --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --metrics smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_tex_throttle,smsp__inst_executed.sum,l1tex__t_bytes.sum,lts__t_bytes.sum,dram__bytes.sum \
      python3 benchmarks/weight_ncu_probe.py $c 2>&1 | grep -vE "^==PROF==|^\s*$" | head -170
done > "$OUT/ncu_ws.txt" 2>&1
grep -E "===|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per|Warp Cycles Per Issued|stalled|inst_executed|Issue Slots Busy|Block Limit|t_bytes|dram__bytes|L1/TEX Hit|L2 Hit" "$OUT/ncu_ws.txt" | head -90
