#!/usr/bin/env bash
# One device call (issue 18, H200, ~3 min): `lowbit audit kernels` with the scale-only (zero none) cases beside the
# rest of the decode-attention and geometry sweeps.
# Usage: scripts/gpu_s15_call4.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
timeout -s INT 200 python3 -m lowbit audit kernels --json "$OUT/audit.json" > "$OUT/audit.log" 2>&1
echo "audit rc $?"; grep -E "scale-only|ok \(|FAIL|fail" "$OUT/audit.log" | head -20; tail -3 "$OUT/audit.log"
