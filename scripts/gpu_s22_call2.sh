#!/usr/bin/env bash
# Call 2 (issue 19, H200): 4- and 8-warp instances, 8-byte scale rows, the scores in independent MMA chains. The CUDA int2 MLA latent middle (lowbit.kernels.latent_cuda) -- its GPU tests
# against the twin, the audit's CUDA latent cases, then `lowbit bench decode-attention` on the latent geometries
# (the bench's candidates now include impl="cuda"), then the geometry kernel's GPU tests (the SPLIT0 change).
# Usage: scripts/gpu_s22_call2.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout -s INT 150 python3 -m pytest -q -m gpu tests/kernels/test_latent_cuda.py > "$OUT/gpu_tests_latent_cuda.log" 2>&1
echo "tests rc $? $(el)"; tail -15 "$OUT/gpu_tests_latent_cuda.log"
timeout -s INT 120 python3 - > "$OUT/audit_latent_cuda.log" 2>&1 <<'PY'
import json
from lowbit.kernels.audit import audit_geometry, geo_sweep
cases = [c for c in geo_sweep("cuda") if c[0] == "decode_latent_cuda"]
rows = audit_geometry("cuda", cases=cases)
for r in rows:
    print(json.dumps(r.__dict__ if hasattr(r, "__dict__") else r._asdict()))
print("ok", sum(r.ok for r in rows), "/", len(rows))
PY
echo "audit rc $? $(el)"; tail -7 "$OUT/audit_latent_cuda.log"
timeout -s INT 240 python3 -m lowbit bench decode-attention --geometry deepseek-v3-latent-tp8,deepseek-v3-latent \
    --batch 1,16 --length 32768 --bits 2 --out "$OUT/decode_attention_latent_cuda.json" > "$OUT/decode_attention_latent_cuda.log" 2>&1
echo "bench rc $? $(el)"; grep -E "config|deepseek" "$OUT/decode_attention_latent_cuda.log" | tail -40
timeout -s INT 150 python3 -m pytest -q -m gpu tests/kernels/test_decode_geometry_odd.py tests/kernels/test_decode_geometry.py \
    > "$OUT/gpu_tests_geometry.log" 2>&1
echo "geometry tests rc $? $(el)"; tail -5 "$OUT/gpu_tests_geometry.log"
