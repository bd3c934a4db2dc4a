#!/usr/bin/env bash
# One device call: weight-kernel GPU tests, `lowbit bench gemm`, the W4A16 + int2 decode row, the weight audit.
# Usage (device tool, repo root): bash scripts/gpu_weights_run.sh [bench|audit|e2e|tests ...]  (default: all)
set -u
export PYTHONPATH="$PWD/src" TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
steps=${*:-tests bench e2e audit}
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
for s in $steps; do
  t=$(date +%s)
  case $s in
    tests) timeout 120 python3 -m pytest -q -x -m gpu tests/kernels/test_weight_gemm.py -p no:cacheprovider > "$OUT/tests.log" 2>&1; tail -4 "$OUT/tests.log" ;;
    bench) timeout ${BENCH_S:-330} python3 -m lowbit bench gemm --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; echo "bench rc $?"; grep -E "M=(1|16|4096) " "$OUT/gemm.log" | grep -E "gate/up|down" | head -40 ;;
    e2e) timeout ${E2E_S:-200} python3 -m lowbit bench decode --batch ${E2E_B:-1,16} --length 32k --paths ${E2E_PATHS:-lowbit-int2,lowbit-w4a16-int2} --steps 20 --out "$OUT/decode_e2e.json" > "$OUT/decode_e2e.log" 2>&1; echo "e2e rc $?"; grep -E "ms/step|weights|FAILED|Error" "$OUT/decode_e2e.log" | tail -12 ;;
    audit) timeout ${AUDIT_S:-150} python3 -m lowbit audit kernels --weights --json "$OUT/audit_weights.json" > "$OUT/audit_weights.log" 2>&1; echo "audit rc $?"; tail -8 "$OUT/audit_weights.log" ;;
  esac
  echo "[$s took $(( $(date +%s) - t )) s]"
done
