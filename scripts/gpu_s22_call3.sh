#!/usr/bin/env bash
# Call 3 (issue 19, H200): the CUDA int2 latent middle as the default for the packed DeepSeek latent
# (decode_geometry.default_impl). GPU tests (the CUDA kernel's, the geometry kernel's latent cases), the whole
# geometry audit, `lowbit bench decode-attention` on the four geometries of issue 19 (the file the issue names),
# and Nsight Compute on the tp8 B16 L32k launch of the 8-warp instance.
# Usage: scripts/gpu_s22_call3.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
timeout -s INT 120 python3 -m pytest -q -m gpu tests/kernels/test_latent_cuda.py \
    "tests/kernels/test_decode_geometry_odd.py::test_odd_sizes_bench_configs_gpu[latent-h16]" \
    "tests/kernels/test_decode_geometry_odd.py::test_odd_sizes_bench_configs_gpu[latent-h3]" \
    > "$OUT/gpu_tests_latent_cuda_default.log" 2>&1
echo "tests rc $? $(el)"; tail -3 "$OUT/gpu_tests_latent_cuda_default.log"
timeout -s INT 150 python3 - > "$OUT/audit_geometry_NVIDIA_H200.log" 2>&1 <<'PY'
import json
from lowbit.kernels.audit import audit_geometry
rows = audit_geometry("cuda")
for r in rows:
    print(json.dumps(r.as_dict()))
print("ok", sum(r.ok for r in rows), "/", len(rows))
json.dump({"rows": [r.as_dict() for r in rows]}, open("audit_geometry_NVIDIA_H200.json", "w"), indent=1)
PY
echo "audit rc $? $(el)"; mv audit_geometry_NVIDIA_H200.json "$OUT/" 2>/dev/null; grep -E "latent|^ok" "$OUT/audit_geometry_NVIDIA_H200.log" | cut -c1-160
timeout -s INT 300 python3 -m lowbit bench decode-attention \
    --geometry deepseek-v3-latent,kimi-k192v128,gemma4-full512,deepseek-v3-latent-tp8 --batch 1,16 --length 32768 \
    --bits 2 --out "$OUT/decode_attention_geometry_NVIDIA_H200.json" > "$OUT/decode_attention_geometry_NVIDIA_H200.log" 2>&1
echo "bench rc $? $(el)"; grep -E "^(deepseek|kimi|gemma)" "$OUT/decode_attention_geometry_NVIDIA_H200.log"
cat > /tmp/one_launch.py <<'PY'
import torch
from lowbit.kernels import geo_bench
from lowbit.kernels.decode_geometry import GeoConfig
fns, keep = geo_bench.latent_fns(geo_bench.GEOMETRIES["deepseek-v3-latent-tp8"], 16, 32768, 2, 1, GeoConfig(impl="cuda", num_warps=8))
for _ in range(3):
    fns[0]()
torch.cuda.synchronize()
PY
timeout -s INT 100 ncu -k regex:latent_int2 -c 1 -s 2 --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section SchedulerStats python3 /tmp/one_launch.py > "$OUT/ncu_latent_cuda_tp8_B16.txt" 2>&1
echo "ncu rc $? $(el)"; grep -E "Duration|Throughput|Registers|Achieved Occupancy|Issued Ipc|Stall|Warp Cycles|One or More|No Eligible|Bank" "$OUT/ncu_latent_cuda_tp8_B16.txt" | head -40
