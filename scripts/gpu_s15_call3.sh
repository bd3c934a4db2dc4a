#!/usr/bin/env bash
# One device call (issue 16/17, H200, ~9 min): the compiled-step GPU tests that run Inductor's PDL codegen, then end to
# end with it (random-weight Llama-3-8B geometry, L=32k): B=1 transformers' StaticCache + compile bf16 beside lowbit
# int2 and W4A16 g128 + int2 through the compiled, captured step; B=16 lowbit int2 and W4A16 + int2 likewise.
# Usage: scripts/gpu_s15_call3.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 150 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/runtime/test_gpu_compiled.py -k pdl \
    > "$OUT/gpu_tests_pdl.log" 2>&1; echo "pdl tests rc $? $(el)"; grep -E "PASSED|FAILED|SKIPPED|^E  |passed|failed" "$OUT/gpu_tests_pdl.log" | head -12
B="python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10 --inductor-pdl"
timeout -s INT 280 $B --batch 1 --paths hf-static-compile-bf16,lowbit-int2-compiled,lowbit-w4a16-int2-compiled \
    --out "$OUT/decode_e2e_B1_pdl.json" > "$OUT/e2e_B1.log" 2>&1; echo "B1 rc $? $(el)"; grep -E "ms/step" "$OUT/e2e_B1.log"
timeout -s INT 150 $B --batch 16 --paths lowbit-int2-compiled,lowbit-w4a16-int2-compiled \
    --out "$OUT/decode_e2e_B16_pdl.json" > "$OUT/e2e_B16.log" 2>&1; echo "B16 rc $? $(el)"; grep -E "ms/step" "$OUT/e2e_B16.log"
