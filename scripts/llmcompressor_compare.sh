#!/usr/bin/env bash
# llm-compressor 0.14 side by side with lowbit on smollm2-135m, both evaluated in lowbit's harness.
#
#   scripts/llmcompressor_compare.sh OUT_ROOT [VENV_DIR]
#
# llm-compressor gets its own venv (default ../venvs/llmc beside the repo), created on
# first use with the CPU torch (constraints-cpu.txt). It quantizes the fp32 model that lowbit
# converted from the GGUF (lowbit's model cache) into OUT_ROOT/llmc-<row>; lowbit's venv then
# measures WikiText-2 PPL of each (OUT_ROOT/llmc_results.jsonl). Heavy; not part of CI.
set -euo pipefail
OUT=${1:?usage: $0 OUT_ROOT [VENV_DIR]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${2:-$ROOT/../venvs/llmc}
LLMC_VERSION=0.14.0.1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -c "$ROOT/constraints-cpu.txt" "llmcompressor==$LLMC_VERSION"
fi

# The fp32 HF directory lowbit builds from the GGUF (built on first use).
MODEL_DIR=$("$ROOT/.venv/bin/python" -c "
from lowbit.models import load
from lowbit.models.load import cache_path
load('smollm2-135m'); print(cache_path('smollm2-135m'))")
(cd "$OUT" && "$VENV/bin/python" "$ROOT/benchmarks/llmcompressor_compare.py" quantize "$MODEL_DIR" "$OUT")
"$ROOT/.venv/bin/python" "$ROOT/benchmarks/llmcompressor_compare.py" eval "$OUT"
