#!/usr/bin/env bash
# One device call (issue 17, H200, ~7 min): A8 weights through the A16 kernels ("a16-xq"): GPU tests, the --a8
# exploration (w8a8 / w4a8-g128 at M 1..4096 beside the tabled int8 cell), the table rebuilt from every committed
# exploration + it (into the tree copy and $OUT), then `lowbit audit kernels --weights` and `lowbit bench gemm` with it.
# Usage: scripts/gpu_s12_call3.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 90 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_gemm.py \
    -k "a16xq or cells_match" > "$OUT/tests.log" 2>&1; echo "tests rc $? $(el)"; grep -E "^FAILED|^E  |passed|failed" "$OUT/tests.log" | head -12
timeout -s INT 200 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_a8.json" --a8 > "$OUT/explore.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^a8 " "$OUT/explore.log" | cut -c1-120
R=benchmarks/results/weights
python3 benchmarks/build_weight_table.py "$OUT/sm90.json" $R/gemm_explore_run1_NVIDIA_H200.json $R/gemm_explore_gemv_NVIDIA_H200.json \
    $R/gemm_explore_final_NVIDIA_H200.json $R/gemm_explore_cuda_NVIDIA_H200.json $R/gemm_explore_quick_NVIDIA_H200.json \
    $R/gemm_explore_s12_NVIDIA_H200.json "$OUT/gemm_explore_a8.json" > "$OUT/table.log" 2>&1
echo "table rc $?"; grep -E "w8a8|w4a8" "$OUT/table.log"; cp "$OUT/sm90.json" src/lowbit/kernels/weight_tables/sm90.json
timeout -s INT 150 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights.json" > "$OUT/audit_weights.log" 2>&1
echo "audit rc $? $(el)"; tail -4 "$OUT/audit_weights.log"
timeout -s INT 150 python3 -m lowbit bench gemm --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; echo "bench rc $? $(el)"
grep -E "^(w8a8|w4a8) .*M=(1|16|64|256|4096) " "$OUT/gemm.log" | cut -c1-120 | head -40
