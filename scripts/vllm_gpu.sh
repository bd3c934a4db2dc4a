#!/usr/bin/env bash
# lowbit's packed KV cache inside GPU vLLM 0.26, on the lent device (`lowbit bench vllm`). Run from the repository root.
#
#   bash scripts/vllm_gpu.sh check                     # ~3-5 min: kernels vs twins on the GPU, vLLM greedy tokens
#   bash scripts/vllm_gpu.sh bench [bench args...]     # rows of `lowbit bench vllm` (--kv-dtypes, --batch, ...)
#   bash scripts/vllm_gpu.sh all                       # check, then the default bench
#
# vLLM must be importable from /tmp/site (the bundle of ../shared/tools/vllm-gpu-bundle.sh, installed by
# /root/vparts/install.sh -- run here when vLLM is missing and the parts are there). lowbit is on PYTHONPATH=src;
# vLLM finds general plugins through entry points, so a minimal lowbit dist-info with the vllm.general_plugins
# entry point is written into /tmp/site (no pip). Every step has a timeout; each kv config of the bench runs in its
# own process with its own timeout; rows accumulate in lowbit-results/vllm_gpu_<gpu>.json across calls
# (copied to $OUT when set). A device call is at most 10 minutes: split the bench over calls, e.g.
#   bash scripts/vllm_gpu.sh bench --kv-dtypes lowbit-int2 --batch 1,16 --per-row-timeout 530 --budget-s 540
#   bash scripts/vllm_gpu.sh bench --kv-dtypes auto,fp8,int4_per_token_head --batch 1,16 --per-row-timeout 175
#   bash scripts/vllm_gpu.sh bench --kv-dtypes lowbit-int2 --batch 16 --profile      # where the step's time goes
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
shift || true
SITE=/tmp/site  # where /root/vparts/install.sh puts the bundle
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
say() { echo "$(date -u +%H:%M:%S) [vllm_gpu.sh] $*"; }

if ! timeout 120 "$PY" -c "import vllm" 2>/dev/null; then
  if [ -f /root/vparts/install.sh ]; then
    say "vLLM not importable: installing the bundle (/root/vparts/install.sh)"
    timeout 420 bash /root/vparts/install.sh || say "FAILED: bundle install (rc $?)"
  fi
fi
timeout 180 "$PY" - <<'EOF' || say "FAILED: version probe"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
try:
    import vllm
    print("vllm", vllm.__version__, vllm.__file__)
except Exception as e:
    print("vllm NOT importable:", type(e).__name__, e)
EOF
mkdir -p "$SITE" 2>/dev/null
rc=0
if [ "$mode" = check ] || [ "$mode" = all ]; then
  say "check"
  timeout 540 "$PY" -m lowbit bench vllm --check --site "$SITE" "$@"; r=$?
  say "check rc $r"; [ $r -ne 0 ] && rc=$r
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  say "bench $*"
  timeout 590 "$PY" -m lowbit bench vllm --length 32k --site "$SITE" "$@"; r=$?
  say "bench rc $r"; [ $r -ne 0 ] && rc=$r
fi
if [ -n "${OUT:-}" ]; then
  cp -v lowbit-results/vllm_gpu_*.json "$OUT"/ 2>/dev/null || true
fi
exit $rc
