#!/usr/bin/env bash
# s21 call 2 (H200, ~2 min): the batching engine's captured-path GPU token test after the V-fold fix (engines over one
# model fold its V rotation once): graphs vs eager at equal widths, decode-ahead vs not at one fixed width.
# Usage: scripts/gpu_s21_call2.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
timeout -s INT 240 python3 -m pytest -q --tb=short -p no:cacheprovider -p no:logging \
    "tests/serve/test_batch_engine.py::test_graphs_path_gives_the_eager_paths_tokens_on_cuda" \
    "tests/serve/test_batch_engine.py::test_engines_over_one_model_fold_its_value_rotation_once" \
    "tests/serve/test_batch_engine.py::test_batch_invariant_logits_do_not_depend_on_the_interleaving" \
    > "$OUT/gpu_tests_decode_ahead_v4_s21_NVIDIA_H200.log" 2>&1; echo "tests rc $?"
grep -E "^E |passed|failed" "$OUT/gpu_tests_decode_ahead_v4_s21_NVIDIA_H200.log" | head -8
