#!/usr/bin/env bash
# One device call (issue 17, H200, ~8 min): the warp-split CUDA kernel (4-bit, M <= 8): the GPU tests of the CUDA
# kernels, then the --cuda-ws exploration (its instances beside the x-staging kernel's tabled config, cuBLAS bf16 on
# the packed bytes' N/4 rows as the bandwidth reference).
# Usage: scripts/gpu_s14_call1.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 150 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_cuda.py \
    > "$OUT/tests.log" 2>&1; echo "tests rc $? $(el)"; grep -E "^FAILED|^E  |passed|failed" "$OUT/tests.log" | head -12
timeout -s INT 380 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_ws.json" --cuda-ws > "$OUT/explore.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^cuda-ws |cuBLAS" "$OUT/explore.log" | cut -c1-160
