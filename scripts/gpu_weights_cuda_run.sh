#!/usr/bin/env bash
# One device call (~5-6 min on the H200): the CUDA C++ small-M weight kernel (src/lowbit/kernels/cuda/,
# lowbit.kernels.gemm.cuda_gemm): its GPU tests against the torch twin, then its exploration beside the Triton
# cell the committed table runs and cuBLAS bf16 (M 1, 2, 4, 8, 16; the 8B shapes; w4a16-g128, w8a16,
# w4a16-g64-asym), JSON + logs under $OUT, and a table of speed-ups over bf16 (best CUDA config / Triton cell).
# Usage (device tool, repo root): bash scripts/gpu_weights_cuda_run.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
TOTAL=${2:-330}  # seconds for tests + exploration (the exploration keeps a partial JSON when cut)
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -1
t0=$(date +%s)
# the first test builds the library (~30-60 s of nvcc) into ~/.cache/lowbit/cuda; the exploration reuses it
timeout -s INT $(( TOTAL / 2 )) python3 -m pytest -q -m gpu tests/kernels/test_weight_cuda.py -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests rc $? [$(( $(date +%s) - t0 ))s]"; tail -15 "$OUT/tests.log"
left=$(( TOTAL - ($(date +%s) - t0) )); [ "$left" -lt $(( TOTAL / 3 )) ] && left=$(( TOTAL / 3 ))  # the exploration gets what the tests left
timeout -s INT "$left" python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_cuda.json" --cuda > "$OUT/explore_cuda.log" 2>&1
echo "explore rc $? [$(( $(date +%s) - t0 ))s]"; grep -E "^cuda " "$OUT/explore_cuda.log" | grep -E "M=(1|16) " | head -24
python3 - "$OUT/gemm_explore_cuda.json" <<'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from gemm_explore import cuda_ratio_table
rows = json.load(open(sys.argv[1]))["explore"]
print(f"{len(rows)} rows; speed-up over cuBLAS bf16, best CUDA config / the tabled Triton cell:")
print(cuda_ratio_table(rows))
best = {}
for r in rows:
    for k, v in r["candidates"].items():
        if k.startswith("cuda-") and isinstance(v, float) and isinstance(r["rel_l2"].get(k), float) and r["rel_l2"][k] < 1e-3:
            best.setdefault(k, []).append(r["bf16_ms"] / v)
for k, v in sorted(best.items(), key=lambda kv: -sum(kv[1]) / len(kv[1]))[:5]:
    print(f"{k}: mean x{sum(v) / len(v):.2f} over {len(v)} rows")
bad = [(r["scheme"], r["shape"], r["M"], k, e) for r in rows for k, e in r["rel_l2"].items()
       if k.startswith("cuda-") and not (isinstance(e, float) and e < 1e-3)]
print(f"cuda candidates failing the twin check (rel L2 >= 1e-3 or error): {len(bad)}", *bad[:8], sep="\n  ")
PY
echo "done [$(( $(date +%s) - t0 ))s]"
