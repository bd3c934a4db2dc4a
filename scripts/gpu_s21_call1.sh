#!/usr/bin/env bash
# Prepared in s20 for the next device call (H200, ~5 min; carry .gpu/cuda):
# (1) issue 16: the captured-path test of the batching engine in its third version (graphs vs eager at equal widths;
#     --decode-ahead vs not at one fixed width): if it passes, decode-ahead can become the graphs path's default;
# (2) issue 17: the table with s20's bench-row shape cells (smollm2 down at M 1 and 9-16) through the audit and
#     `lowbit bench gemm` (s20's bench ran that cell at 0.42x with the bucket pick; s18's kernel ran it at 0.96x).
# Usage: scripts/gpu_s21_call1.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 150 python3 -m pytest -q --tb=short -p no:cacheprovider -p no:logging \
    "tests/serve/test_batch_engine.py::test_graphs_path_gives_the_eager_paths_tokens_on_cuda" \
    > "$OUT/gpu_tests_decode_ahead_s21_NVIDIA_H200.log" 2>&1; echo "tests rc $? $(el)"
grep -E "^E |passed|failed" "$OUT/gpu_tests_decode_ahead_s21_NVIDIA_H200.log" | head -8
timeout -s INT 120 python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights_s21_NVIDIA_H200.json" \
    > "$OUT/audit_weights_s21_NVIDIA_H200.log" 2>&1; echo "audit rc $? $(el)"; tail -3 "$OUT/audit_weights_s21_NVIDIA_H200.log"
timeout -s INT 130 python3 -m lowbit bench gemm --out "$OUT/gemm_NVIDIA_H200.json" > "$OUT/gemm_NVIDIA_H200.log" 2>&1
echo "bench gemm rc $? $(el)"; grep -E "smollm2 down +M=(1|16) " "$OUT/gemm_NVIDIA_H200.log" | head -8
