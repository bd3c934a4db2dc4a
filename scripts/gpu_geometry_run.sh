#!/usr/bin/env bash
# One device call for issue 19's GPU part (the geometry decode kernel), <= ~5 min on an H200:
#   0. (background, CPU) the issue-19 CPU tests on this image's transformers (5.17): MLA, Gemma-4, Qwen2.5-VL, families
#   1. gpu-marked kernel tests vs the torch twins (full-size MLA latent / Gemma-4 K=V / Kimi K192/V128 / 512 GQA)
#   2. lowbit audit kernels --device cuda --kernel decode_geometry  (the new cases only)
#   3. lowbit bench decode-attention --geometry deepseek-v3-latent,deepseek-v3-latent-tp8,kimi-k192v128,gemma4-full512
# Usage: bash scripts/gpu_geometry_run.sh "$OUT"   (stage limits in seconds: CPU_S, TEST_S, AUDIT_S, BENCH_S)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee "$OUT/env.txt"

# 0. CPU tests (tests/conftest.py runs the kernels' CPU tests through the interpreter; these use the torch path)
( env -u TRITON_INTERPRET CUDA_VISIBLE_DEVICES= timeout -s INT ${CPU_S:-270} python3 -m pytest -q -p no:cacheprovider \
    tests/kv/test_mla.py tests/kv/test_gemma4.py tests/kv/test_qwen_vl.py tests/models/test_families.py \
    > "$OUT/cpu_tests.log" 2>&1; echo "cpu tests rc $?" >> "$OUT/cpu_tests.log" ) &
CPU_PID=$!

export TRITON_INTERPRET=0
# 1. GPU tests
timeout -s INT ${TEST_S:-100} python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_decode_geometry.py \
    > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc $?"
tail -n 15 "$OUT/gpu_tests.log"
# 2. audit (new cases only)
timeout -s INT ${AUDIT_S:-70} python3 -m lowbit audit kernels --device cuda --kernel decode_geometry \
    --json "$OUT/audit_geometry_NVIDIA_H200.json" > "$OUT/audit.log" 2>&1; echo "audit rc $?"
tail -n 32 "$OUT/audit.log"
# 3. bench
timeout -s INT ${BENCH_S:-200} python3 -m lowbit bench decode-attention \
    --geometry deepseek-v3-latent,kimi-k192v128,gemma4-full512,deepseek-v3-latent-tp8 --batch 1,16 --length 32k \
    --bits ${BITS:-2,4} --out "$OUT/decode_attention_geometry_NVIDIA_H200.json" > "$OUT/bench.log" 2>&1; echo "bench rc $?"
grep -vE "^\s*$" "$OUT/bench.log" | tail -n 30

wait $CPU_PID
tail -n 8 "$OUT/cpu_tests.log"
