#!/usr/bin/env bash
# One device call (issues 17 and 18, H200, ~6 min): (1) the warp-split W4A16 kernel with x prefetched into L1 a ring
# depth ahead (CudaConfig.xpf): its GPU tests, then `gemm_explore.py --cuda-xpf` (each launch with and without, M 1 / 8
# / 16, 8B + fused shapes); (2) the compiled, captured decode step with grid "mse" scale-only int2 (the step searched
# at write time inside the graph) against the eager step.
# Usage: scripts/gpu_s18_call1.sh "$OUT"      (carry .gpu/cuda: the library built on the CPU host)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 150 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_cuda.py \
    > "$OUT/gpu_tests_weight_cuda_xpf.log" 2>&1; echo "tests rc $? $(el)"
grep -E "FAILED|^E  |passed|failed" "$OUT/gpu_tests_weight_cuda_xpf.log" | head -20
timeout -s INT 240 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_xpf.json" --cuda-xpf > "$OUT/gemm_explore_xpf.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^XPF" "$OUT/gemm_explore_xpf.log" | head -30
timeout -s INT 150 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/runtime/test_gpu_compiled.py \
    -k "follows_the_eager_step" > "$OUT/gpu_tests_compiled_mse.log" 2>&1; echo "compiled tests rc $? $(el)"
grep -E "FAILED|^E  |passed|failed" "$OUT/gpu_tests_compiled_mse.log" | head -12
