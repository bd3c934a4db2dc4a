#!/usr/bin/env bash
# One device call (issue 17, H200, ~8 min): the small-M CUDA kernel with 4 / 8 activation tiles (M <= 64) and
# x staged in shared-memory windows -- GPU tests, the --cuda-quick exploration (M 1/4/16/32/64, dequantize +
# cuBLAS timed beside it above 16), the dispatch table rebuilt from the committed explorations + it (written into
# the tree copy and $OUT), bench gemm's rows for M <= 64.
# The library built on the CPU host is carried in .gpu/cuda (placed when the device nvcc is the same release).
# Usage: scripts/gpu_s11_call1.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 120 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_cuda.py \
    > "$OUT/tests.log" 2>&1; echo "tests rc $? $(el)"; grep -E "^FAILED|^E  |passed|failed" "$OUT/tests.log" | head -12
timeout -s INT 260 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_quick.json" --cuda-quick > "$OUT/explore.log" 2>&1
echo "explore rc $? $(el)"; tail -12 "$OUT/explore.log"
python3 benchmarks/build_weight_table.py "$OUT/sm90.json" benchmarks/results/weights/gemm_explore_run1_NVIDIA_H200.json \
    benchmarks/results/weights/gemm_explore_gemv_NVIDIA_H200.json benchmarks/results/weights/gemm_explore_final_NVIDIA_H200.json \
    benchmarks/results/weights/gemm_explore_cuda_NVIDIA_H200.json benchmarks/results/weights/gemm_explore_quick_NVIDIA_H200.json \
    "$OUT/gemm_explore_quick.json" > "$OUT/table.log" 2>&1
echo "table rc $?"; cat "$OUT/table.log"; cp "$OUT/sm90.json" src/lowbit/kernels/weight_tables/sm90.json
timeout -s INT 130 python3 benchmarks/gemm_small_m.py "$OUT/gemm_small_m.json" > "$OUT/gemm.log" 2>&1
echo "gemm rc $? $(el)"; grep -E "M=(1|16|17|32|64) " "$OUT/gemm.log" | cut -c1-120 | head -40
