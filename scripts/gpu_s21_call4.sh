#!/usr/bin/env bash
# s21 call 4 (H200, <= 9 min; carry .gpu/cuda): the GPU tests of the runtime (captured and compiled decode steps,
# generate), the static cache (tests/kv/test_gpu.py) and the batching engine's captured path, on the final tree of s21.
# Usage: scripts/gpu_s21_call4.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 scripts/place_cuda_lib.py
# the serve test is not marked gpu (it skips without CUDA), so it runs apart from the -m gpu selection
timeout -s INT 120 python3 -m pytest -q --tb=short -p no:cacheprovider -p no:logging \
    "tests/serve/test_batch_engine.py::test_graphs_path_gives_the_eager_paths_tokens_on_cuda" \
    > "$OUT/gpu_tests_serve_s21_NVIDIA_H200.log" 2>&1; echo "serve test rc $?"; tail -1 "$OUT/gpu_tests_serve_s21_NVIDIA_H200.log"
timeout -s INT 420 python3 -m pytest -q --tb=short -p no:cacheprovider -p no:logging --durations=15 -m gpu \
    tests/runtime tests/kv/test_gpu.py > "$OUT/gpu_tests_runtime_kv_s21_NVIDIA_H200.log" 2>&1; echo "tests rc $?"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_runtime_kv_s21_NVIDIA_H200.log" | tail -12
