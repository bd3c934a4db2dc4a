#!/usr/bin/env bash
# The DiT image rows on a GPU (H200): the same eval and capacity matrix as dit_images_cpu.sh, with --device cuda
# (quantized linears through lowbit.weights.qlinear.prepare_cuda's kernels). The GPU image has no diffusers: carry
# .whl/ (diffusers-0.42.1-py3-none-any.whl, importlib_metadata-*.whl, zipp-*.whl: pure-python wheels, fetched with
# `pip download --no-deps -d .whl diffusers==0.42.1 importlib_metadata zipp`); artifacts/dit-digits32 is tracked.
#   bash scripts/dit_images_gpu.sh RESULTS_DIR [PYTHON]      e.g. bash scripts/dit_images_gpu.sh "$OUT" python
# Writes RESULTS_DIR/{eval_gpu.json, eval_gpu.md, grid_gpu.png, summary_gpu.json, capacity_gpu.json}.
set -euo pipefail
cd "$(dirname "$0")/.."
RES=${1:?results directory}
PY=${2:-python}
"$PY" -c "import diffusers" 2>/dev/null || "$PY" -m pip install -q --no-deps .whl/diffusers-0.42.1-py3-none-any.whl \
  .whl/importlib_metadata-*.whl .whl/zipp-*.whl
LB=("$PY" -m lowbit)
MODEL=artifacts/dit-digits32
CK=$(mktemp -d)/dit
mkdir -p "$CK" "$RES"
LIST=""
for scheme in w8a16 w8a8 w4a16-g64; do
  for method in rtn gptq; do
    "${LB[@]}" quantize --model "$MODEL" --component transformer --scheme "$scheme" --method "$method" \
      --out "$CK/$scheme-$method"
    LIST="$LIST,$CK/$scheme-$method"
  done
done
"$PY" -c "
from lowbit.diffusion.plant import plant_failure
plant_failure('$CK/w8a16-rtn', '$CK/w8a16-rtn-planted-nan', linear='transformer_blocks.2.attn1.to_q', kind='nan')"
LIST="${LIST#,},$CK/w8a16-rtn-planted-nan"
for dt in fp32 bf16; do
  "${LB[@]}" eval images --device cuda --image-dtype "$dt" --model "$MODEL" --checkpoints "$LIST" --classes 0-7 \
    --seeds 0-3 --steps 25 --json "$RES/eval_gpu_$dt.json" --markdown "$RES/eval_gpu_$dt.md" \
    --plot "$RES/grid_gpu_$dt.png" --summary "$RES/summary_gpu_$dt.json" || true   # exit 1: a row failed (planted)
done
# M = 2 (guidance) x batch x tokens: 128 px / patch 8 = 256 tokens, batch 64 -> 32k rows per linear
"${LB[@]}" bench images --device cuda --image-dtype bf16 --model "$MODEL" \
  --checkpoints "$CK/w8a16-rtn,$CK/w8a8-rtn,$CK/w4a16-g64-gptq" --batch 1,16,64,256 --resolution 32,64,128 \
  --steps 10 --out "$RES/capacity_gpu.json"
