#!/usr/bin/env bash
# One device call (issue 17, H200, ~4 min): W8A8 through TMA descriptors (GemmConfig.tma): its GPU tests against the
# twin (odd M, N 1001, bias), the W8A8 audit cells, then `gemm_explore.py --a8-tma` beside the table's tiles.
# Usage: scripts/gpu_s18_call3.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
timeout -s INT 200 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_gemm.py \
    -k "tma or (cells_match_twin and w8a8)" > "$OUT/gpu_tests_w8a8_tma.log" 2>&1; echo "tests rc $? $(el)"
grep -E "FAILED|^E  |passed|failed" "$OUT/gpu_tests_w8a8_tma.log" | head -20
timeout -s INT 330 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_a8_tma.json" --a8-tma \
    > "$OUT/gemm_explore_a8_tma.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^a8-tma" "$OUT/gemm_explore_a8_tma.log" | head -50
