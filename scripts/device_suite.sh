#!/usr/bin/env bash
# One device call runs one named suite; every output lands in $OUT (or the second argument).
#
#   scripts/device_suite.sh SUITE [OUT_DIR]
#
# Suites:
#   tests      the GPU test suite (pytest -m gpu): kernels against their torch twins on the card
#   audit      `lowbit audit kernels`: every kernel against its twin over the audit's sizes, as JSON
#   decode     `lowbit bench decode`: end-to-end decode steps, Llama-3-8B geometry, L = 32k, B = 1 / 16,
#              transformers' compiled bf16 and lowbit's runtime in one run
#   kernels    `lowbit bench decode-attention`: the fused decode kernel vs SDPA flash, same run
#   gemm       `lowbit bench gemm --candidates all`: per (scheme, Llama-3-8B shape, M) lowbit's table cell, humming and
#              dequantize + cuBLAS, each audited against the torch twin then timed in a CUDA graph beside cuBLAS bf16
#              of the same run; the winners as this card's dispatch table. humming comes from vLLM's bundle, which
#              must already be installed in /tmp/site (see the vllm suite); without it the humming column says why
#   vllm       scripts/vllm_gpu.sh (vLLM must already be installed from the carried bundle: see that script)
# Result files are named by what they measure and the card, never by when (see RESULTS.md).
set -u
suite=${1:?usage: scripts/device_suite.sh tests|audit|decode|kernels|gemm|vllm [OUT_DIR]}
OUT=${2:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))" 2>/dev/null || echo unknown)
case "$suite" in
  tests)   timeout -s INT 540 python3 -m pytest -q -rA --tb=short -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu_tests_$gpu.log" | tail -40 ;;
  audit)   timeout -s INT 540 python3 -m lowbit audit kernels --json "$OUT/audit_$gpu.json" 2>&1 | tail -30 ;;
  decode)  timeout -s INT 540 python3 -m lowbit bench decode --geometry llama3-8b --length 32k --batch 1,16 \
               --paths hf-static-compile-bf16,lowbit-int2 --out "$OUT/decode_e2e_$gpu.json" 2>&1 | tail -30 ;;
  kernels) timeout -s INT 540 python3 -m lowbit bench decode-attention --geometry llama3-8b --batch 1,16 \
               --length 8192,32768 --bits 2,4 --out "$OUT/decode_attention_$gpu.json" 2>&1 | tail -30 ;;
  gemm)    export PYTHONPATH="$PWD/src:/tmp/site:$PYTHONPATH" HUMMING_CACHE_DIR=/tmp/humming_cache
           timeout -k 10 -s INT 70 python3 -m lowbit.kernels.gemm.humming 2>&1 | tee "$OUT/gemm_humming_probe_$gpu.log" | tail -8
           timeout -k 15 -s INT 200 python3 -m lowbit bench gemm --schemes w4a16-g128,w8a16,w4a8,w8a8 --m 1,16,64,256,4096 \
               --candidates all --budget-s 140 --table "$OUT/gemm_table_$gpu.json" --out "$OUT/gemm_candidates_$gpu.json" \
               2>&1 | tee "$OUT/gemm_candidates_$gpu.log" | tail -70 ;;
  vllm)    bash scripts/vllm_gpu.sh "$OUT" ;;
  *)       echo "error: unknown suite '$suite'; use tests, audit, decode, kernels, gemm or vllm" >&2; exit 2 ;;
esac
