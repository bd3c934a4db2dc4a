#!/usr/bin/env bash
# s21 call 3 (H200, ~8 min; carry .whl-serve): `lowbit serve` with today's defaults (batching engine, CUDA graphs,
# decode-ahead on) under 1 / 8 / 32 streams of the official openai client (4,096-token prompts, 512 tokens out), against
# one `lowbit bench decode` B32 L4096 row of the same call: the canonical serve_load_NVIDIA_H200.json.
# Usage: scripts/gpu_s21_call3.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
bash scripts/serve_load_gpu.sh "$OUT" --levels 1,8,32 > "$OUT/serve_load_s21.log" 2>&1; echo "serve load rc $?"
grep -E "^C=|target|rc |bench" "$OUT/serve_load_s21.log" | tail -10
