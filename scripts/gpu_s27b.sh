#!/usr/bin/env bash
# s27 second device call (H200; carry .gpu/cuda): issue 17.
#  (1) benchmarks/probes/gemv_tiles_probe.py: the Triton A16 GEMV over tile shapes at M = 1 (W8A16 per-channel now
#      honours GPT, so a program can hold a whole row slab), beside bf16, the tabled cell and the read floor;
#  (2) the weight audit of W8A16 (its tabled gate/up M=1 gemv cell now runs the GPT it names);
#  (3) ncu stall reasons of the M=1 W4A16 warp-split kernel (gate/up).
# Usage: scripts/gpu_s27b.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py > /dev/null
timeout -s INT 330 python3 benchmarks/probes/gemv_tiles_probe.py "$OUT/gemv_tiles_s27_NVIDIA_H200.json" \
    > "$OUT/gemv_tiles_s27_NVIDIA_H200.log" 2>&1; echo "probe rc $? $(el)"; grep -v "^\s*$" "$OUT/gemv_tiles_s27_NVIDIA_H200.log" | tail -8
timeout -s INT 90 python3 -c "
import json, sys
from lowbit.kernels.weight_audit import audit_weights, LLM_SHAPES
rows, _ = audit_weights('cuda', schemes=('w8a16',), shapes=[s for s in LLM_SHAPES if s[0].startswith('llama3-8b')], ms=(1, 2, 4, 16))
bad = [r.as_dict() for r in rows if not r.ok]
print(len(rows), 'cells', len(bad), 'failed', bad[:3]); json.dump([r.as_dict() for r in rows], open(sys.argv[1], 'w'), indent=1)
" "$OUT/audit_w8a16_s27_NVIDIA_H200.json" > "$OUT/audit_w8a16_s27_NVIDIA_H200.log" 2>&1; echo "audit rc $? $(el)"; tail -2 "$OUT/audit_w8a16_s27_NVIDIA_H200.log"
timeout 100 ncu --clock-control none -k regex:wq_warp_split --launch-skip 2 --launch-count 1 \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum \
    python3 benchmarks/weight_ncu_probe.py w4a16-g128 14336 4096 1 cuda-ws-rt2-w4-nb3-sk0-pdl 2>&1 | grep -vE "^==PROF==|^\s*$" \
    > "$OUT/ncu_stalls_m1_s27_NVIDIA_H200.txt" 2>&1; echo "ncu $(el)"
sort -k3 -g -r "$OUT/ncu_stalls_m1_s27_NVIDIA_H200.txt" | grep -E "stalled|issue_active|dram|duration" | head -14
