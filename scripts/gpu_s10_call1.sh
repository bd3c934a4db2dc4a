#!/usr/bin/env bash
# One device call (issues 16 + 17, H200, ~9 min): the fold GPU test at its tolerance; Nsight Compute on the
# small-M W4A16 CUDA kernel (M 1 and 16, gate/up and down); torch's int4 GEMM (tinygemm) beside lowbit's
# W4A16 cells; the W4A16 + int2 compiled decode row at B1; B16 int2 compiled (folded) beside lowbit bf16 and
# transformers eager bf16 in one run.
# Usage: scripts/gpu_s10_call1.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
timeout -s INT 100 python3 -m pytest -rA --tb=short -p no:cacheprovider -m gpu tests/runtime/test_gpu_runtime.py \
    -k "fused_projections" > "$OUT/tests.log" 2>&1; echo "tests rc $? $(el)"
grep -E "^(PASSED|FAILED|ERROR)|^E  |passed|failed" "$OUT/tests.log" | tail -6
{
for c in "w4a16-g128 14336 4096 1 cuda-rt2-w8-sk4" "w4a16-g128 4096 14336 1 cuda-rt2-w8-sk0" \
         "w4a16-g128 14336 4096 16 cuda-rt1-w8-sk0" "w4a16-g128 1024 4096 1 cuda-rt1-w4-sk0"; do
  echo "=== $c"
  timeout 60 ncu --clock-control none -k regex:wq_small_m --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats python3 benchmarks/weight_ncu_probe.py $c 2>&1 \
      | grep -vE "^==PROF==|^\s*$" | head -120
done
} > "$OUT/ncu.txt" 2>&1; echo "ncu done $(el)"; grep -E "===|DRAM Throughput|Duration|Achieved Occupancy|Registers Per|Waves Per SM|Memory Throughput" "$OUT/ncu.txt" | head -40
timeout -s INT 150 python3 benchmarks/tinygemm_probe.py "$OUT/tinygemm.json" > "$OUT/tinygemm.log" 2>&1
echo "tinygemm rc $? $(el)"; grep -E "M=(1|16|64) " "$OUT/tinygemm.log" | head -20; tail -2 "$OUT/tinygemm.log"
B="python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10"
timeout -s INT 170 $B --batch 1 --paths lowbit-w4a16-int2-compiled --out "$OUT/e2e_w4_B1.json" > "$OUT/e2e_w4.log" 2>&1
echo "w4 B1 rc $? $(el)"; grep -E "ms/step" "$OUT/e2e_w4.log"
timeout -s INT 300 $B --batch 16 --paths lowbit-int2-compiled,lowbit-bf16,hf-eager-bf16 --out "$OUT/e2e_B16.json" \
    > "$OUT/e2e_B16.log" 2>&1; echo "B16 rc $? $(el)"; grep -E "ms/step" "$OUT/e2e_B16.log"
