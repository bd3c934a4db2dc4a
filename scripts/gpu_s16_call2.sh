#!/usr/bin/env bash
# One device call (issue 16/17, H200, ~9 min): the compiled-step GPU tests after the rotation rule change (a traced
# rotation is a GEMM above 64 rows: static_cache._ROT_SUM_ROWS), then end to end at B=16, L=32k, random-weight
# Llama-3-8B geometry, one process: transformers eager bf16, lowbit int2 and W4A16 g128 + int2 through the compiled,
# captured step (Inductor PDL: the default where torch has it).
# Usage: scripts/gpu_s16_call2.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 170 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/runtime/test_gpu_compiled.py \
    > "$OUT/gpu_tests_compiled.log" 2>&1; echo "tests rc $? $(el)"; grep -E "PASSED|FAILED|^E  |passed|failed" "$OUT/gpu_tests_compiled.log" | head -14
timeout -s INT 380 python3 -m lowbit bench decode --geometry llama3-8b --length 32k --steps 10 --batch 16 \
    --paths hf-eager-bf16,lowbit-int2-compiled,lowbit-w4a16-int2-compiled --out "$OUT/decode_e2e_B16.json" \
    > "$OUT/e2e_B16.log" 2>&1
echo "e2e rc $? $(el)"; grep -E "ms/step|triton_red|_stage1|nvjet|wq_|busy" "$OUT/e2e_B16.log" | head -40; tail -3 "$OUT/e2e_B16.log"
