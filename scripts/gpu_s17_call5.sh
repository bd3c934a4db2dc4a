#!/usr/bin/env bash
# One device call (issue 19, H200, ~8 min): the batch-aware MLA latent launch (decode_geometry.few_pairs) -- the
# geometry kernels' GPU tests and audit cases with it, then `lowbit bench decode-attention` on the DeepSeek-V3 latent
# (128 heads and tp8) at B 1 / 4 / 16, L32k, int2 vs lowbit's bf16 latent path and torch, one run.
# Usage: scripts/gpu_s17_call5.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
timeout -s INT 150 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/kernels/test_decode_geometry.py \
    tests/kernels/test_decode_geometry_odd.py > "$OUT/gpu_tests_geometry.log" 2>&1; echo "tests rc $? $(el)"
grep -E "FAILED|^E  |passed|failed" "$OUT/gpu_tests_geometry.log" | head -12
timeout -s INT 90 python3 -m lowbit audit kernels --device cuda --kernel decode_geometry --json "$OUT/audit_geometry.json" \
    > "$OUT/audit_geometry.log" 2>&1; echo "audit rc $? $(el)"; tail -3 "$OUT/audit_geometry.log"
timeout -s INT 240 python3 -m lowbit bench decode-attention --geometry deepseek-v3-latent-tp8,deepseek-v3-latent \
    --batch 1,4,16 --length 32768 --bits 2 --out "$OUT/decode_attention_geometry_latent.json" > "$OUT/bench_latent.log" 2>&1
echo "bench rc $? $(el)"; grep -E "deepseek" "$OUT/bench_latent.log" | tail -8
