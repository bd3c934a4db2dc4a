#!/usr/bin/env bash
# One device call (issue 16, H200, <= 4 min): the runtime's GPU tests (the eager captured step and
# DecodeGraphs(compile=True)), then `lowbit bench decode` with the eager-captured and the compiled-captured
# runtime side by side at B 1 and 16, L 32k. Usage: scripts/gpu_runtime_compiled_run.sh "$OUT"
# Full logs stay in $OUT (tests.log keeps every failure's traceback: -rA, no -q summary only).
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee "$OUT/versions.txt"
timeout -s INT ${TESTS_S:-90} python3 -m pytest -rA -x --tb=long -p no:cacheprovider \
    tests/runtime/test_gpu_compiled.py tests/runtime/test_gpu_runtime.py > "$OUT/tests.log" 2>&1; echo "tests rc $?"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL)|passed|failed" "$OUT/tests.log" | tail -15
timeout -s INT ${BENCH_S:-140} python3 -m lowbit bench decode --geometry llama3-8b --batch 1,16 --length 32k \
    --paths lowbit-int2,lowbit-int2-compiled,lowbit-w4a16-int2-compiled --out "$OUT/decode_e2e_compiled.json" \
    > "$OUT/decode_e2e_compiled.log" 2>&1; echo "bench rc $?"
grep -E "ms/step|weights |Error|error" "$OUT/decode_e2e_compiled.log" | tail -12
