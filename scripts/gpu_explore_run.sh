#!/usr/bin/env bash
# One device call: the weight-GEMM exploration (benchmarks/gemm_explore.py) + gemlite side by side.
set -u
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
pip install -q --no-deps wheels/gemlite-*.whl > "$OUT/pip.log" 2>&1 || echo "gemlite install failed"
timeout -s INT ${EXPLORE_S:-400} python3 benchmarks/gemm_explore.py "$OUT/explore.json" --no-gemlite > "$OUT/explore.log" 2>&1; echo "explore rc $?"
grep -E "M=(1|16|4096) " "$OUT/explore.log" | head -40
timeout -s INT ${GEMLITE_S:-150} python3 benchmarks/gemm_explore.py "$OUT/gemlite.json" --no-explore > "$OUT/gemlite.log" 2>&1; echo "gemlite rc $?"
tail -30 "$OUT/gemlite.log"
