#!/usr/bin/env bash
# Prepared in s19 for the next device call (issue 17, H200, ~5 min): the warp-split W4A16 kernel under launch bound 256
# (CudaConfig.bound: up to 255 registers; under the default bound 512 the tabled RT 2 instances spill, ptxas: 208 B of
# spill stores a thread at M 9-16, 48 B at M <= 8): its GPU tests against the twin (WS_CONFIGS has two lb256 configs),
# then `gemm_explore.py --cuda-lb` beside the same launches under bound 512.
# Usage: scripts/gpu_s20_call1.sh "$OUT"      (carry .gpu/cuda: the library built on the CPU host)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
T=tests/kernels/test_weight_cuda.py
timeout -s INT 150 python3 -m pytest -q --tb=short -p no:cacheprovider "$T::test_gpu_warp_split_matches_twin" \
    "$T::test_gpu_warp_split_graph_replay_with_split_k" "$T::test_warp_split_names_conditions_and_plan" \
    > "$OUT/gpu_tests_cuda_lb.log" 2>&1; echo "tests rc $? $(el)"; tail -3 "$OUT/gpu_tests_cuda_lb.log"
timeout -s INT 240 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_cuda_lb.json" --cuda-lb \
    > "$OUT/gemm_explore_cuda_lb.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^cuda-lb" "$OUT/gemm_explore_cuda_lb.log"
