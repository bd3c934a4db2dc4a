#!/usr/bin/env bash
# One device call (issue 16, H200, ~7 min): the batching engine's decode-ahead on the GPU. (1) the captured-path test
# (greedy tokens with steps queued ahead = without = eager, tiny model); (2) `lowbit serve` (random llama3-8b, int2,
# graphs, 32 slots, no compile) under 1 and 32 streams of 4,096-token prompts and 512 tokens out with --decode-ahead and
# (3) the same server without, both against one `lowbit bench decode` B32 L4096 row. (It ran at commit 4591e72
# where decode-ahead was the graphs path's default and the flag was --no-decode-ahead; the flags below are today's.)
# Usage: scripts/gpu_s20_call5.sh "$OUT"      (carry .whl-serve)
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
timeout -s INT 150 python3 -m pytest -q --tb=short -p no:cacheprovider \
    "tests/serve/test_batch_engine.py::test_graphs_path_gives_the_eager_paths_tokens_on_cuda" \
    > "$OUT/gpu_tests_decode_ahead_s20_NVIDIA_H200.log" 2>&1; echo "tests rc $? $(el)"; tail -2 "$OUT/gpu_tests_decode_ahead_s20_NVIDIA_H200.log"
bash scripts/serve_load_gpu.sh "$OUT/ahead" --levels 1,32 --extra "--decode-ahead" > "$OUT/ahead.log" 2>&1; echo "ahead rc $? $(el)"
grep -E "^C=|target|rc |bench" "$OUT/ahead.log" | tail -8
bash scripts/serve_load_gpu.sh "$OUT/no_ahead" --levels 1,32 --bench-from "$OUT/ahead/decode_b32.json" \
    > "$OUT/no_ahead.log" 2>&1; echo "no-ahead rc $? $(el)"
grep -E "^C=|target|rc |bench" "$OUT/no_ahead.log" | tail -8
