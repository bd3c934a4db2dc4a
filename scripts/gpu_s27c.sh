#!/usr/bin/env bash
# s27 third device call (H200; carry .gpu/cuda): issue 17, the table with s27's W8A16 M=1 GEMV shape cells
# (benchmarks/results/weights/s27/gemm_explore_gemv_tiles_s27_NVIDIA_H200.json): the W8A16 weight audit over its whole
# sweep (every shape and M the table serves), then `lowbit bench gemm --read-floor` at small M on the 8B shapes.
# Usage: scripts/gpu_s27c.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py > /dev/null
timeout -s INT 120 python3 -c "
import json, sys
from lowbit.kernels.weight_audit import audit_weights
rows, _ = audit_weights('cuda', schemes=('w8a16',))
bad = [r.as_dict() for r in rows if not r.ok]
print(len(rows), 'cells', len(bad), 'failed', bad[:3]); json.dump([r.as_dict() for r in rows], open(sys.argv[1], 'w'), indent=1)
" "$OUT/audit_w8a16_table_s27_NVIDIA_H200.json" > "$OUT/audit_w8a16_table_s27_NVIDIA_H200.log" 2>&1
echo "audit rc $? $(el)"; tail -2 "$OUT/audit_w8a16_table_s27_NVIDIA_H200.log"
timeout -s INT 150 python3 -m lowbit bench gemm --schemes w4a16-g128,w8a16 --m 1,2,4,8,16 --read-floor \
    --shapes "llama3-8b qkv/o;llama3-8b gate/up;llama3-8b down;llama3-8b k/v" \
    --out "$OUT/gemm_small_m_s27_NVIDIA_H200.json" > "$OUT/gemm_small_m_s27_NVIDIA_H200.log" 2>&1
echo "bench gemm rc $? $(el)"; grep -E "^w8a16 " "$OUT/gemm_small_m_s27_NVIDIA_H200.log" | grep "M=1 "
