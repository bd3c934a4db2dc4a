#!/usr/bin/env bash
# Prepared in s26 for the next device call (issue 18, H200, ~6 min; not yet run): one-byte ue5m3 scales
# (TensorQuant scale_format "ue5m3") in the fused decode kernel, and the VQ-row kernel (lowbit.kernels.decode_vq).
# (1) the scale-format tests on CUDA; (2) `lowbit audit kernels` (its CUDA sweep has three ue5m3 cases and four
# decode_vq cases); (3) `lowbit bench decode-attention --bits 2so,2s8,4so,4s8,2vq` (fp16 vs one-byte scales of
# scale-only groups, and VQ 2x16 / 4x256 rows) on the Llama-3-8B and Gemma-3 geometries and at smollm2's.
# Usage: scripts/gpu_s26_kv_formats.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
timeout -s INT 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/kv/test_scale_format.py \
    tests/kernels/test_audit_cases.py > "$OUT/gpu_tests_scale_format.log" 2>&1; echo "tests rc $? $(el)"
grep -E "^E |passed|failed|FAIL" "$OUT/gpu_tests_scale_format.log" | head -10
timeout -s INT 150 python3 -m lowbit audit kernels --kernel decode_vq --json "$OUT/audit_decode_vq_s26.json" \
    > "$OUT/audit_decode_vq_s26.log" 2>&1; echo "audit vq rc $? $(el)"; tail -7 "$OUT/audit_decode_vq_s26.log"
timeout -s INT 150 python3 -c "
import json, sys
from lowbit.kernels.audit import audit, sweep, format_table
rows = audit('cuda', cases=[c for c in sweep('cuda') if c[1].get('scale_format') == 'ue5m3'], kernels=('decode_attention',))
print(format_table(rows)); json.dump([r.as_dict() for r in rows], open(sys.argv[1], 'w'), indent=1)
" "$OUT/audit_ue5m3_s26.json" > "$OUT/audit_ue5m3_s26.log" 2>&1; echo "audit ue5m3 rc $? $(el)"; tail -5 "$OUT/audit_ue5m3_s26.log"
timeout -s INT 200 python3 -m lowbit bench decode-attention --geometry llama3-8b,gemma3-1b \
    --batch 1,16 --length 8192,32768 --bits 2so,2s8,4so,4s8,2vq --out "$OUT/decode_attention_scale_format_s26.json" \
    > "$OUT/decode_attention_scale_format_s26.log" 2>&1; echo "bench rc $? $(el)"; tail -10 "$OUT/decode_attention_scale_format_s26.log"
timeout -s INT 80 python3 -m lowbit bench decode-attention --geometry smollm2-135m --batch 1,16 --length 8192 \
    --bits 2so,2s8,4so,4s8,2vq --out "$OUT/decode_attention_scale_format_smollm2_s26.json" \
    > "$OUT/decode_attention_scale_format_smollm2_s26.log" 2>&1; echo "bench smollm2 rc $? $(el)"
tail -3 "$OUT/decode_attention_scale_format_smollm2_s26.log"
