#!/usr/bin/env bash
# One device call (issues 17 and 16, H200, ~6 min): (1) the persistent W8A8 TMA kernel (GemmConfig.persistent): GPU
# tests against the twin (odd M, N 1001, bias), then `gemm_explore.py --a8-ps` beside the one-tile-per-program TMA
# kernel; (2) B16 int2 with the one-graph compiled step (--compile whole) against the per-layer row of call 2.
# Usage: scripts/gpu_s19_call3.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
timeout -s INT 120 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/kernels/test_weight_gemm.py \
    -k "tma" > "$OUT/gpu_tests_w8a8_tma_ps_s19_NVIDIA_H200.log" 2>&1; echo "tests rc $? $(el)"
grep -E "FAILED|^E  |passed|failed" "$OUT/gpu_tests_w8a8_tma_ps_s19_NVIDIA_H200.log" | head -20
timeout -s INT 150 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_a8_ps_s19_NVIDIA_H200.json" --a8-ps \
    > "$OUT/gemm_explore_a8_ps_s19_NVIDIA_H200.log" 2>&1
echo "explore rc $? $(el)"; grep -E "^a8-ps" "$OUT/gemm_explore_a8_ps_s19_NVIDIA_H200.log"
python3 - "$OUT/gemm_explore_a8_ps_s19_NVIDIA_H200.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["explore"]:
    c = r["candidates"]
    tma = min(v for k, v in c.items() if k.endswith("-tma")); ps = min(v for k, v in c.items() if k.endswith("-ps"))
    print(f"{r['shape']:<14} M={r['M']:<5} bf16 {r['bf16_ms']*1e3:7.1f} us  tma {tma*1e3:7.1f} ({r['bf16_ms']/tma:.2f}x)  "
          f"ps {ps*1e3:7.1f} ({r['bf16_ms']/ps:.2f}x)")
P
timeout -s INT 200 python3 -m lowbit bench decode --batch 16 --length 32k --steps 20 --paths lowbit-int2 --compile whole \
    --out "$OUT/decode_e2e_B16_whole_s19_NVIDIA_H200.json" > "$OUT/decode_e2e_B16_whole_s19_NVIDIA_H200.log" 2>&1
echo "whole rc $? $(el)"; grep -E "ms/step" "$OUT/decode_e2e_B16_whole_s19_NVIDIA_H200.log"
