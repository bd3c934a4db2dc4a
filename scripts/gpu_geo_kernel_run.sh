#!/usr/bin/env bash
# Issue 19 (the geometry decode kernel made fast), one device call, <= ~8 min on an H200:
#   1. gpu-marked geometry kernel tests vs the torch twins (MLA latent 128/16 heads, Gemma-4 K = V, Kimi K192/V128)
#   2. the config sweep per geometry (python -m lowbit.tools.bench.geometry --sweep): deepseek-v3-latent,
#      deepseek-v3-latent-tp8, kimi-k192v128, gemma4-full512 at B 1/16, L 32768, int2 (+ the bf16 dense-latent
#      path for the DeepSeek rows), CUDA-graph timing over rotating input sets (lowbit.tools.bench.attention.graph_time_ms)
#   3. lowbit bench decode-attention --geometry ... with the new defaults (the committed results file's format)
# Usage: bash scripts/gpu_geo_kernel_run.sh "$OUT"
#   stage limits in seconds: TEST_S, SWEEP_S, BENCH_S; SWEEP_GEOS / BENCH_BITS narrow stages 2 / 3.
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src"
export TRITON_INTERPRET=0
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" \
    | tee "$OUT/env.txt"
GEOS=deepseek-v3-latent,deepseek-v3-latent-tp8,kimi-k192v128,gemma4-full512

# 1. GPU tests (compiles every default variant once; the Triton cache then serves stage 3)
timeout -s INT ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_decode_geometry.py \
    tests/kernels/test_decode_geometry_odd.py > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc $?"
tail -n 12 "$OUT/gpu_tests.log"

# 2. config sweep (rows also stream to the log as SWEEPROW lines, so a cut-short run keeps what it timed)
timeout -s INT ${SWEEP_S:-200} python3 -m lowbit.tools.bench.geometry --sweep "$OUT/geo_sweep_NVIDIA_H200.json" \
    --geometry ${SWEEP_GEOS:-$GEOS} --batch 1,16 --length 32768 --bits 2 > "$OUT/sweep.log" 2>&1; echo "sweep rc $?"
grep -E "^SWEEP |failed" "$OUT/sweep.log" | tail -n 30

# 3. the committed benchmark with the new defaults
timeout -s INT ${BENCH_S:-100} python3 -m lowbit bench decode-attention --geometry $GEOS --batch 1,16 --length 32k \
    --bits ${BENCH_BITS:-2} --out "$OUT/decode_attention_geometry_NVIDIA_H200.json" > "$OUT/bench.log" 2>&1
echo "bench rc $?"
grep -vE "^\s*$|^ROW " "$OUT/bench.log" | tail -n 20
