#!/usr/bin/env bash
# The DiT image rows of benchmarks/results/images/ on the CPU, from the committed model:
# quantize the transformer (w8a16, w8a8, w4a16-g64) x (rtn, gptq), plant one NaN linear in a copy of the
# w8a16 RTN checkpoint, run `lowbit eval images` (8 classes x 4 seeds, 25 DDIM steps) and `lowbit bench images`.
# Checkpoints go to out/dit/ (not committed); results to benchmarks/results/images/ (refused if they exist).
#   bash scripts/dit_images_cpu.sh            # ~10 min on 2 shared cores, 1 thread
set -euo pipefail
cd "$(dirname "$0")/.."
LB=.venv/bin/lowbit
MODEL=artifacts/dit-digits32
OUT=out/dit
RES=benchmarks/results/images
mkdir -p "$OUT" "$RES"
CKPTS=()
for scheme in w8a16 w8a8 w4a16-g64; do
  for method in rtn gptq; do
    d="$OUT/$scheme-$method"
    [ -d "$d" ] || $LB quantize --model "$MODEL" --component transformer --scheme "$scheme" --method "$method" --out "$d"
    $LB verify "$d" | tail -1
    CKPTS+=("$d")
  done
done
P="$OUT/w8a16-rtn-planted-nan"
[ -d "$P" ] || .venv/bin/python -c "
from lowbit.diffusion.plant import plant_failure
plant_failure('$OUT/w8a16-rtn', '$P', linear='transformer_blocks.2.attn1.to_q', kind='nan')"
P0="$OUT/w8a16-rtn-planted-zero"
[ -d "$P0" ] || .venv/bin/python -c "
from lowbit.diffusion.plant import plant_failure
plant_failure('$OUT/w8a16-rtn', '$P0', linear='proj_out_2', kind='zero')"
ALL=$(IFS=,; echo "${CKPTS[*]},$P,$P0")
$LB eval images --model "$MODEL" --checkpoints "$ALL" --classes 0-7 --seeds 0-3 --steps 25 \
  --json "$RES/eval.json" --markdown "$RES/eval.md" --plot "$RES/grid.png" --summary "$RES/summary.json" || true
$LB bench images --model "$MODEL" --checkpoints "$OUT/w8a16-rtn,$OUT/w8a8-rtn,$OUT/w4a16-g64-rtn" \
  --batch 1,8,32 --resolution 32,64 --steps 10 --out "$RES/capacity_cpu.json"
