#!/usr/bin/env bash
# One device call (issue 17, H200, ~8 min): the warp-split W4A16 kernel with its chunk ring in shared memory
# (cp.async; CudaConfig.ring) -- its GPU tests against the twin, then the exploration at M 1/4/8/16 beside the
# register-ring configs the committed table runs (benchmarks/gemm_explore.py --cuda-ring).
# Usage: scripts/gpu_s17_call2.sh "$OUT"      (carry .gpu/cuda: the library built on the CPU host)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 200 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_cuda.py \
    > "$OUT/gpu_tests_weight_cuda_ring.log" 2>&1; echo "tests rc $? $(el)"
grep -E "FAILED|^E  |passed|failed" "$OUT/gpu_tests_weight_cuda_ring.log" | head -20
timeout -s INT 330 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_ring.json" --cuda-ring > "$OUT/gemm_explore_ring.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^cuda-ring" "$OUT/gemm_explore_ring.log"
