#!/usr/bin/env bash
# s27 device call (H200; carry .gpu/cuda built from this tree):
#  issue 18: `lowbit audit kernels --kernel decode_vq` (its CUDA sweep now has three 1-bit-residual cases) and
#            `lowbit bench decode-attention --bits 2s8,2rs,2vq` (int2 one-byte scales; + the residual; VQ rows);
#  issue 17: `lowbit bench gemm --read-floor` at M 1/4/16 (W4A16 g128, W8A16) on the Llama-3-8B shapes: the fastest
#            single read of each packed weight in the same harness, so the ceiling bf16_ms / read_ms is measured;
#            Nsight Compute on the M=1 W4A16 warp-split kernel (gate/up and qkv/o).
# Usage: scripts/gpu_s27.sh "$OUT"
set -u
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s]"; }
python3 scripts/place_cuda_lib.py
timeout -s INT 150 python3 -m lowbit audit kernels --kernel decode_vq --json "$OUT/audit_decode_vq_s27.json" \
    > "$OUT/audit_decode_vq_s27.log" 2>&1; echo "audit vq rc $? $(el)"; tail -9 "$OUT/audit_decode_vq_s27.log"
timeout -s INT 150 python3 -m lowbit bench decode-attention --geometry llama3-8b --batch 1,16 --length 8192,32768 \
    --bits 2s8,2rs,2vq --out "$OUT/decode_attention_residual_s27.json" > "$OUT/decode_attention_residual_s27.log" 2>&1
echo "bench kv rc $? $(el)"; tail -5 "$OUT/decode_attention_residual_s27.log"
timeout -s INT 60 python3 -m lowbit bench decode-attention --geometry smollm2-135m --batch 1,16 --length 8192 \
    --bits 2s8,2rs --out "$OUT/decode_attention_residual_smollm2_s27.json" \
    > "$OUT/decode_attention_residual_smollm2_s27.log" 2>&1; echo "bench kv smollm2 rc $? $(el)"
tail -3 "$OUT/decode_attention_residual_smollm2_s27.log"
timeout -s INT 200 python3 -m lowbit bench gemm --schemes w4a16-g128,w8a16 --m 1,4,16 --read-floor \
    --shapes "llama3-8b qkv/o;llama3-8b gate/up;llama3-8b down;llama3-8b k/v" \
    --out "$OUT/gemm_read_floor_s27_NVIDIA_H200.json" > "$OUT/gemm_read_floor_s27_NVIDIA_H200.log" 2>&1
echo "bench gemm rc $? $(el)"; cat "$OUT/gemm_read_floor_s27_NVIDIA_H200.log" | tail -26
for c in "w4a16-g128 14336 4096 1 cuda-ws-rt2-w4-nb3-sk0-pdl" "w4a16-g128 4096 4096 1 cuda-ws-rt1-w8-nb3-sk0-lb256-pdl"; do
  echo "=== $c"
  timeout 100 ncu --clock-control none -k regex:wq_warp_split --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section LaunchStats --section MemoryWorkloadAnalysis \
      python3 benchmarks/weight_ncu_probe.py $c 2>&1 | grep -vE "^==PROF==|^\s*$" | head -140
done > "$OUT/ncu_warp_split_m1_s27_NVIDIA_H200.txt" 2>&1
echo "ncu $(el)"; grep -E "===|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Stall Long|Eligible Warps|Waves Per SM|Grid Size|Block Size" \
    "$OUT/ncu_warp_split_m1_s27_NVIDIA_H200.txt" | head -40
