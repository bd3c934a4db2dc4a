#!/usr/bin/env bash
# s23 call 2 (H200; carry .gpu/cuda): the tiled kernel's weight copies with an L2 prefetch size (call 1 streamed the
# weight at ~0.9 TB/s even at M = 17): GPU tests, then `gemm_explore.py --cuda-tiled-l2`.
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 200 python3 -m pytest -q --tb=short -p no:cacheprovider -p no:logging -x \
    tests/kernels/test_weight_tiled.py > "$OUT/gpu_tests_tiled_l2_s23_NVIDIA_H200.log" 2>&1; echo "tests rc $? $(el)"
grep -E "^E |passed|failed|Error" "$OUT/gpu_tests_tiled_l2_s23_NVIDIA_H200.log" | head -12
timeout -s INT 300 python3 benchmarks/gemm_explore.py "$OUT/gemm_explore_tiled_l2_s23_NVIDIA_H200.json" --cuda-tiled-l2 \
    > "$OUT/gemm_explore_tiled_l2_s23_NVIDIA_H200.log" 2>&1; echo "explore rc $? $(el)"
python3 - "$OUT/gemm_explore_tiled_l2_s23_NVIDIA_H200.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["explore"]:
    c = {k: v for k, v in r["candidates"].items() if isinstance(v, float)}
    top = sorted(c, key=c.get)[:4]
    print(r["shape"], r["M"], f"bf16 {r['bf16_ms']*1e3:.1f}", " | ".join(f"{k.replace('cuda-tl-','')} {c[k]*1e3:.1f}" for k in top))
    for l2 in ("-l2p0", "-l2p128", ""):
        for sk in ("sk0", "sk1", "sk4"):
            ks = [k for k in c if k.endswith(f"{sk}{l2}-pdl")]
            print("   ", sk, l2 or "-l2p256", " ".join(f"{c[k]*1e3:.1f}" for k in ks))
PY
