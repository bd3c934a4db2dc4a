#!/usr/bin/env bash
# One device call (issue 17, H200, ~9 min): swapped-operand A16 configs (y^T = W x^T): their GPU tests, the --swap
# exploration (w4a16-g128 / w8a16 at M 4..1024 beside the tabled cell and dequantize + cuBLAS), and whether Triton
# lowered their dots to wgmma (the PTX in Triton's cache).
# Usage: scripts/gpu_s13_call1.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 120 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_gemm.py \
    -k "swapped" > "$OUT/tests.log" 2>&1; echo "tests rc $? $(el)"; grep -E "^FAILED|^E  |passed|failed" "$OUT/tests.log" | head -12
timeout -s INT 430 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_swap.json" --swap > "$OUT/explore.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^swap " "$OUT/explore.log" | cut -c1-140
C=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
for f in $(ls "$C"/*/_wq_swap_kernel.ptx 2>/dev/null | head -200); do
  echo "$(grep -c wgmma.mma_async "$f") wgmma $(grep -c 'mma.sync' "$f") mma.sync $(grep -m1 -o 'BM[^ ]*' "$f")"
done | sort | uniq -c | head -20
ls "$C"/*/_wq_swap_kernel.ptx 2>/dev/null | wc -l
