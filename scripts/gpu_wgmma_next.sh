#!/usr/bin/env bash
# Prepared in s24 for the next device call (not yet run; carry .gpu/cuda built from this tree): the tiled kernel's
# wgmma instances with 1 and 3 groups in flight (TiledConfig.wg): the tiled file's GPU tests (the refusal case that
# poisoned s24 call 1's process now skips on a Hopper), `gemm_explore.py --cuda-wgmma`, and Nsight Compute on the
# 4-warpgroup instance at gate/up M 64 (which stall holds each k16 step at ~600 cycles, NOTES round 22).
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 200 python3 -m pytest -q --tb=short -p no:cacheprovider -p no:logging \
    tests/kernels/test_weight_tiled.py > "$OUT/gpu_tests_tiled_wg3_NVIDIA_H200.log" 2>&1; echo "tests rc $? $(el)"
grep -E "^E |passed|failed|Error|FAIL" "$OUT/gpu_tests_tiled_wg3_NVIDIA_H200.log" | head -20
X=benchmarks/results/weights/gemm_explore_wgmma3_NVIDIA_H200.json
timeout -s INT 200 python3 benchmarks/gemm_explore.py $X --cuda-wgmma > "$OUT/gemm_explore_wgmma3_NVIDIA_H200.log" 2>&1
echo "explore rc $? $(el)"; cp $X "$OUT/"
grep -E "best" "$OUT/gemm_explore_wgmma3_NVIDIA_H200.log" | grep "g128" | sed "s/^cuda-wgmma //" | cut -c1-150
for c in "w4a16-g128 14336 4096 64 cuda-tl-wn16-wm1-rt1-mt8-s4-sk0-bw-wg-pdl" \
         "w4a16-g128 14336 4096 64 cuda-tl-wn16-wm1-rt1-mt8-s4-sk0-bw-wg3-pdl"; do
  echo "=== $c"
  timeout 100 ncu --clock-control none -k regex:wq_wgmma --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section InstructionStats --section MemoryWorkloadAnalysis \
      python3 benchmarks/weight_ncu_probe.py $c 2>&1 | grep -vE "^==PROF==|^\s*$" | head -160
done > "$OUT/ncu_wgmma_NVIDIA_H200.txt" 2>&1
echo "ncu $(el)"; grep -E "===|Duration|DRAM Throughput|Warp Cycles Per Issued|Stall|Issue Slots Busy|Executed Ipc|Tensor" "$OUT/ncu_wgmma_NVIDIA_H200.txt" | head -60
