#!/usr/bin/env bash
# s23 call 6 (H200; carry .gpu/cuda): the tiled kernel v2 (x permuted once per stage by its copying threads, not in
# every warp's B path; 3-stage ring; folded 16 x 64 / 32 x 64 warp tiles): GPU tests; `gemm_explore.py --cuda-tiled` (exact and folded, M 17-4096); the dispatch table rebuilt
# with it (buckets 65-128 / 129-256 split); the audit and `lowbit bench gemm` on the new table.
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 240 python3 -m pytest -q --tb=short -p no:cacheprovider -p no:logging -x \
    tests/kernels/test_weight_tiled.py > "$OUT/gpu_tests_tiled_v2_s23_NVIDIA_H200.log" 2>&1; echo "tests rc $? $(el)"
grep -E "^E |passed|failed|Error" "$OUT/gpu_tests_tiled_v2_s23_NVIDIA_H200.log" | head -12
X=benchmarks/results/weights/gemm_explore_tiled_v2_s23_NVIDIA_H200.json
timeout -s INT 200 python3 benchmarks/gemm_explore.py $X --cuda-tiled > "$OUT/gemm_explore_tiled_v2_s23_NVIDIA_H200.log" 2>&1
echo "explore rc $? $(el)"; cp $X "$OUT/"
grep -E "best" "$OUT/gemm_explore_tiled_v2_s23_NVIDIA_H200.log" | grep "g128" | sed "s/^cuda-tiled //" | cut -c1-140
B=$(python3 -c "import json; print(' '.join(json.load(open('src/lowbit/kernels/weight_tables/sm90.json'))['built_from']))")
python3 benchmarks/build_weight_table.py src/lowbit/kernels/weight_tables/sm90.json $B \
    $X > "$OUT/table_s23_v2.txt" 2>&1
echo "table rc $? $(el)"; cp src/lowbit/kernels/weight_tables/sm90.json "$OUT/"; grep "^w4a16" "$OUT/table_s23_v2.txt" | head -40
timeout -s INT 150 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights_s23_v2_NVIDIA_H200.json" \
    > "$OUT/audit_weights_s23_v2_NVIDIA_H200.log" 2>&1; echo "audit rc $? $(el)"; tail -3 "$OUT/audit_weights_s23_v2_NVIDIA_H200.log"
timeout -s INT 170 python3 -m lowbit bench gemm --out "$OUT/gemm_NVIDIA_H200.json" > "$OUT/gemm_NVIDIA_H200.log" 2>&1
echo "bench gemm rc $? $(el)"; grep -E "w4a16-g128 +llama3-8b (gate/up|down|qkv/o) +M=(17|32|64|128|256) " "$OUT/gemm_NVIDIA_H200.log" | head -20
