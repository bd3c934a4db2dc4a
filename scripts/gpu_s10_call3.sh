#!/usr/bin/env bash
# One device call (issue 17, H200, ~8 min): the small-M CUDA kernel with the floor split-K rule -- GPU tests,
# the --cuda-quick exploration, the dispatch table rebuilt from the committed explorations + it (written into
# the tree copy and $OUT), bench gemm's rows for M <= 64, the W4A16 + int2 B1 compiled decode row.
# The library built on the CPU host is carried in .gpu/cuda (placed when the device nvcc is the same release).
# Usage: scripts/gpu_s10_call3.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 60 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_cuda.py \
    > "$OUT/tests.log" 2>&1; echo "tests rc $? $(el)"; grep -E "^FAILED|^E  |passed|failed" "$OUT/tests.log" | head -8
timeout -s INT 100 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_quick.json" --cuda-quick > "$OUT/explore.log" 2>&1
echo "explore rc $? $(el)"; tail -10 "$OUT/explore.log"
python3 benchmarks/build_weight_table.py "$OUT/sm90.json" benchmarks/results/weights/gemm_explore_run1_NVIDIA_H200.json \
    benchmarks/results/weights/gemm_explore_gemv_NVIDIA_H200.json benchmarks/results/weights/gemm_explore_final_NVIDIA_H200.json \
    benchmarks/results/weights/gemm_explore_cuda_NVIDIA_H200.json \
    "$OUT/gemm_explore_quick.json" > "$OUT/table.log" 2>&1
echo "table rc $?"; cp "$OUT/sm90.json" src/lowbit/kernels/weight_tables/sm90.json
timeout -s INT 110 python3 benchmarks/gemm_small_m.py "$OUT/gemm_small_m.json" > "$OUT/gemm.log" 2>&1
echo "gemm rc $? $(el)"; grep -E "M=(1|16|64) " "$OUT/gemm.log" | cut -c1-120 | head -24
timeout -s INT 200 python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10 --batch 1 \
    --paths lowbit-w4a16-int2-compiled --out "$OUT/e2e_w4_B1.json" > "$OUT/e2e_w4.log" 2>&1
echo "w4 B1 rc $? $(el)"; grep -E "ms/step|wq_small" "$OUT/e2e_w4.log"
