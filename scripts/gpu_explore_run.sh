#!/usr/bin/env bash
# One device call: the weight-GEMM exploration (benchmarks/gemm_explore.py): GEMV sweep + gemlite side by side.
set -u
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps wheels/gemlite-*.whl > "$OUT/pip.log" 2>&1 || echo "gemlite install failed"
python3 -c "import gemlite; print('gemlite', gemlite.__version__)"
timeout -s INT ${GEMV_S:-200} python3 benchmarks/gemm_explore.py "$OUT/gemv.json" --gemv > "$OUT/gemv.log" 2>&1; echo "gemv rc $?"
grep -E "^gemv" "$OUT/gemv.log" | head -30; grep -B2 -A8 Traceback "$OUT/gemv.log" | head -20
timeout -s INT ${GEMLITE_S:-200} python3 benchmarks/gemm_explore.py "$OUT/gemlite.json" --no-explore > "$OUT/gemlite.log" 2>&1; echo "gemlite rc $?"
grep -E "^gemlite" "$OUT/gemlite.log" | head -50; grep -A12 Traceback "$OUT/gemlite.log" | head -20
