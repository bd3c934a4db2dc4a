#!/usr/bin/env bash
# One device call (issues 17 and 18, H200, ~5 min): (1) the A8 row quantizer reading a row once (K <= 16384): GPU tests,
# then `lowbit bench gemm`; (2) `lowbit bench decode-attention --bits 2,2so,4so`: int2 / scale-only int2 and int4 (the
# shipped @2.5 recipes' format) on the Llama-3-8B, Gemma-3 (1b = 270m's attention), Qwen2.5-0.5B and SmolLM2 geometries.
# Usage: scripts/gpu_s18_call5.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 120 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_gemm.py \
    -k "a8_activation or tma" > "$OUT/gpu_tests_a8_rows.log" 2>&1; echo "tests rc $? $(el)"
grep -E "FAILED|^E  |passed|failed" "$OUT/gpu_tests_a8_rows.log" | head -10
timeout -s INT 150 python3 -m lowbit bench gemm --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; echo "bench gemm rc $? $(el)"
grep -E "^w8a8 .*M=4096 " "$OUT/gemm.log" | head -8
timeout -s INT 150 python3 -m lowbit bench decode-attention --geometry llama3-8b,gemma3-1b,qwen2.5-coder-0.5b \
    --batch 1,16 --length 8192,32768 --bits 2,2so,4so --out "$OUT/decode_attention_scale_only.json" \
    > "$OUT/decode_attention_scale_only.log" 2>&1; echo "bench so rc $? $(el)"; tail -14 "$OUT/decode_attention_scale_only.log"
timeout -s INT 60 python3 -m lowbit bench decode-attention --geometry smollm2-135m --batch 1,16 --length 8192 \
    --bits 2,2so,4so --out "$OUT/decode_attention_scale_only_smollm2.json" > "$OUT/decode_attention_scale_only_smollm2.log" 2>&1
echo "bench so smollm2 rc $? $(el)"; tail -3 "$OUT/decode_attention_scale_only_smollm2.log"
