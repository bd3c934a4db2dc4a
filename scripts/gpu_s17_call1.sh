#!/usr/bin/env bash
# One device call (issue 16, H200, ~8 min): the CUDA C++ int2 decode stage 1 (kernels/cuda/decode_int2.cu) -- its GPU
# tests against the twin and the Triton kernel, then inside the runtime's cache (every layer once per step, as the
# decode step reads them) each (warps, min blocks) instance at its own and at forced split counts vs Triton, at
# B16 / B64 L32k and B1 L32k, random-weight Llama-3-8B geometry.
# Usage: scripts/gpu_s17_call1.sh "$OUT"      (carry .gpu/cuda)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout -s INT 200 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/kernels/test_decode_cuda.py \
    > "$OUT/gpu_tests_decode_cuda.log" 2>&1; echo "tests rc $? $(el)"
grep -E "PASSED|FAILED|^E  |passed|failed" "$OUT/gpu_tests_decode_cuda.log" | head -30
IMPLS=triton,cuda-w4-s3-mb3,cuda-w4-s4-mb3,cuda-w4-s3-mb1,cuda-w4-s2-mb1,cuda-w4-s3-mb4,cuda-w2-s4-mb1,cuda-w8-s2-mb2
for BL in "16 32768" "64 32768" "1 32768" "1 131072"; do
  set -- $BL
  timeout -s INT 150 python3 benchmarks/kernel_in_step_probe.py --batch $1 --length $2 --impls $IMPLS \
      --out "$OUT/decode_cuda_probe_B$1_L$2.json" > "$OUT/decode_cuda_probe_B$1_L$2.log" 2>&1
  echo "probe B$1 L$2 rc $? $(el)"; grep -E "us/call|failed|rel L2" "$OUT/decode_cuda_probe_B$1_L$2.log" | head -60
done
