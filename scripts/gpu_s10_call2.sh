#!/usr/bin/env bash
# One device call (issue 17, H200, ~9 min): the small-M CUDA weight kernel with the cp.async shared-memory
# weight ring -- GPU tests vs the twin, Nsight Compute on one register-ring and one cp.async launch, the
# --cuda-cp exploration, a dispatch table rebuilt from it (under $OUT), the W4A16 + int2 B1 compiled decode row
# with that table. The library built on the CPU host is carried in .gpu/cuda and placed in the build cache
# when the device's nvcc is the same release (the cache key is the sha256 of source, nvcc --version, flags).
# Usage: scripts/gpu_s10_call2.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 - <<'PY'
import re, shutil, subprocess
from pathlib import Path
from lowbit.kernels import weight_cuda as wc
dev = subprocess.run([wc.find_nvcc(), "--version"], capture_output=True, text=True).stdout
loc = Path(".gpu/cuda/nvcc_version.txt").read_text()
rel = lambda t: re.search(r"release [0-9.]+", t)[0]
dst, src = wc.cache_path("sm_90a"), next(Path(".gpu/cuda").glob("*.so"))
print("device nvcc:", rel(dev), "| host nvcc:", rel(loc))
if rel(dev) == rel(loc) and not dst.exists():
    shutil.copy(src, dst); print("placed", dst.name)
PY
timeout -s INT 100 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_cuda.py \
    > "$OUT/tests.log" 2>&1; echo "tests rc $? $(el)"; grep -E "^FAILED|^E  |passed|failed" "$OUT/tests.log" | head -12
{
for c in "w4a16-g128 14336 4096 1 cuda-rt2-w8-sk0" "w4a16-g128 14336 4096 1 cuda-rt2-w4-sk0-cp6"; do
  echo "=== $c"
  timeout 40 ncu --clock-control none -k regex:wq_small_m --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats python3 benchmarks/weight_ncu_probe.py $c 2>&1 | grep -vE "^==PROF==|^\s*$" | head -90
done
} > "$OUT/ncu.txt" 2>&1; echo "ncu $(el)"; grep -E "===|DRAM Throughput|Duration|Achieved Occupancy|Registers Per|No kernels" "$OUT/ncu.txt" | head -20
timeout -s INT 170 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_cp.json" --cuda-cp > "$OUT/explore_cp.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^cuda-cp " "$OUT/explore_cp.log" | cut -c1-150; tail -12 "$OUT/explore_cp.log"
python3 benchmarks/build_weight_table.py "$OUT/sm90.json" benchmarks/results/weights/gemm_explore_run1_NVIDIA_H200.json \
    benchmarks/results/weights/gemm_explore_gemv_NVIDIA_H200.json benchmarks/results/weights/gemm_explore_final_NVIDIA_H200.json \
    benchmarks/results/weights/gemm_explore_cuda_NVIDIA_H200.json "$OUT/gemm_explore_cp.json" > "$OUT/table.log" 2>&1
echo "table rc $?"; cp "$OUT/sm90.json" src/lowbit/kernels/weight_tables/sm90.json && grep -E '"config"' src/lowbit/kernels/weight_tables/sm90.json | head -8
timeout -s INT 230 python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10 --batch 1 \
    --paths lowbit-w4a16-int2-compiled --out "$OUT/e2e_w4_B1.json" > "$OUT/e2e_w4.log" 2>&1
echo "w4 B1 rc $? $(el)"; grep -E "ms/step|wq_small" "$OUT/e2e_w4.log"
