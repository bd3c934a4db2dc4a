#!/usr/bin/env bash
# One device call (issues 16 and 17, H200, ~8 min): call 3's timeline put the W4A16 + int2 B16 step at 8.81 ms of GPU
# span while its event-timed steps read 9.3-9.6 ms (the first step, queued behind the warm-up, 8.80): the host's launch
# of the graph shows in every step timed from an idle GPU. `lowbit bench decode` now also records host_launch_ms and
# ms_per_step_back_to_back; B 1 and 16, int2 with bf16 and with W4A16 weights, one-graph compile, one run.
# Usage: scripts/gpu_s20_call4.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 560 python3 -m lowbit bench decode --batch 1,16 --length 32k --steps 20 --compile whole \
    --paths lowbit-int2,lowbit-w4a16-int2 --out "$OUT/decode_e2e_launch_s20_NVIDIA_H200.json" \
    > "$OUT/decode_e2e_launch_s20_NVIDIA_H200.log" 2>&1
echo "e2e rc $? $(el)"; grep -E "ms/step" "$OUT/decode_e2e_launch_s20_NVIDIA_H200.log"
