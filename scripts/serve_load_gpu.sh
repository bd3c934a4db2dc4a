#!/usr/bin/env bash
# One device call: `lowbit serve` of a random-weight model (random:llama3-8b, int2 KV, the
# batching engine with CUDA graphs) under 1 / 8 / 32 concurrent streams of the official openai client (long
# prompts, fixed output length), plus the `lowbit bench decode` row at B = the largest level, in the same call.
#   bash scripts/serve_load_gpu.sh "$OUT"                 # H200 defaults: prompt 4096, 512 tokens out, 1,8,32
#   bash scripts/serve_load_gpu.sh DIR --geometry tiny-llama --device cpu --levels 1,3 --prompt 40 \
#        --max-tokens 6 --python .venv/bin/python        # CPU smoke (tests/serve/test_serve_load_script.py)
# Steps: (1) fastapi / uvicorn / openai from the carried wheel folder .whl-serve/ if the python lacks them
# (pip --no-index --find-links: only what is missing; nothing here needs torch or transformers); (2) the bench
# row (on CPU it only shows its command line parses: bench decode refuses to run without CUDA); (3) the server,
# port 0, its log in OUT/server.log, stopped at exit whatever happens; (4) scripts/serve_load.py, which writes
# OUT/serve_load_<gpu>.json with the levels, the bench row and the ratio. Exit status: the client's (or 3/4
# when the wheels or the server failed). Worst case under 10 min: pip, bench 150 s, server up 240 s, client 170 s.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: serve_load_gpu.sh OUT_DIR [--geometry G] [--device cuda|cpu] [--levels 1,8,32] [--prompt N] [--max-tokens N] [--prefill-chunk N] [--python PY] [--extra "SERVE ARGS"] [--bench-from JSON]}
shift
GEO=llama3-8b DEV=cuda LEVELS=1,8,32 PROMPT=4096 MAXTOK=512 CHUNK=2048 PY=python3 EXTRA="" BENCH_FROM=""
while [ $# -gt 0 ]; do
  case "$1" in
    --geometry) GEO=$2 ;;
    --device) DEV=$2 ;;
    --levels) LEVELS=$2 ;;
    --prompt) PROMPT=$2 ;;
    --max-tokens) MAXTOK=$2 ;;
    --prefill-chunk) CHUNK=$2 ;;
    --python) PY=$2 ;;
    --extra) EXTRA=$2 ;;            # more `lowbit serve` arguments, e.g. "--no-decode-ahead"
    --bench-from) BENCH_FROM=$2 ;;  # a bench JSON of this same call to compare against (no second bench run)
    *) echo "serve_load_gpu.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T0=$(date +%s)
say() { echo "[serve_load $(( $(date +%s) - T0 ))s] $*"; }

# (1) the serve extra and the client, from wheels when missing
if ! "$PY" -c "import fastapi, uvicorn, openai" 2>/dev/null; then
  [ -d .whl-serve ] || { say ".whl-serve/ is missing: carry it (see the header)"; exit 3; }
  say "installing the missing serve packages from .whl-serve/"
  if ! "$PY" -m pip install --no-index --find-links .whl-serve --no-cache-dir --no-compile -q \
      fastapi uvicorn openai > "$OUT/pip.log" 2>&1; then
    # a constraint of the image's pip config can refuse a version: the wheels then go to a folder of their own
    say "pip into the environment failed (tail below); installing into /tmp/serve-site instead"
    tail -5 "$OUT/pip.log"
    "$PY" -m pip install --no-index --no-deps --no-cache-dir --no-compile -q --upgrade --target /tmp/serve-site \
      .whl-serve/*.whl >> "$OUT/pip.log" 2>&1 || { say "pip --target failed"; tail -20 "$OUT/pip.log"; exit 3; }
    export PYTHONPATH="$PYTHONPATH:/tmp/serve-site"
  fi
  "$PY" -c "import fastapi, uvicorn, openai; print('fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'openai', openai.__version__)" \
    || { say "the serve packages still do not import"; tail -20 "$OUT/pip.log"; exit 3; }
fi

B=$(echo "$LEVELS" | tr , '\n' | sort -n | tail -1)
BENCH_JSON="$OUT/decode_b${B}.json"
# (2) the benchmark row the target compares against: B = the largest level, L = the prompt length
if [ -n "$BENCH_FROM" ]; then
  cp "$BENCH_FROM" "$BENCH_JSON"; say "bench row from $BENCH_FROM"
else
  say "bench decode: lowbit-int2 B=$B L=$PROMPT"
  timeout -s INT 150 "$PY" -m lowbit bench decode --geometry "$GEO" --paths lowbit-int2 --batch "$B" \
    --length "$PROMPT" --steps 20 --compile off --out "$BENCH_JSON" > "$OUT/bench.log" 2>&1
  say "bench rc $?: $(grep -E 'ms/step|error' "$OUT/bench.log" | tail -2)"
fi

# (3) the server
if [ "$DEV" = cpu ]; then DPATH=eager DTYPE=fp32; else DPATH=graphs DTYPE=bf16; fi
SERVE=(-m lowbit serve --model "random:$GEO" --device "$DEV" --dtype "$DTYPE" --kv int2 --engine batch
       --decode-path "$DPATH" --max-active "$B" --max-context $((PROMPT + MAXTOK + 16)) --prefill-chunk "$CHUNK"
       --host 127.0.0.1 --port 0 $EXTRA)
say "starting: $PY ${SERVE[*]}"
"$PY" "${SERVE[@]}" > "$OUT/server.log" 2>&1 &
SPID=$!
stop_server() {
  if kill -0 "$SPID" 2>/dev/null; then
    kill -TERM "$SPID" 2>/dev/null
    for _ in $(seq 40); do kill -0 "$SPID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SPID" 2>/dev/null
  fi
  wait "$SPID" 2>/dev/null
  say "server stopped"
}
trap stop_server EXIT
trap 'exit 130' INT TERM
URL=""
for _ in $(seq 480); do  # up to 240 s: model build, static cache, graph capture of every bucket
  URL=$(sed -n 's/^listening on \(http[^ ]*\).*/\1/p' "$OUT/server.log" | head -1)
  [ -n "$URL" ] && break
  kill -0 "$SPID" 2>/dev/null || { say "the server exited:"; tail -30 "$OUT/server.log"; exit 4; }
  sleep 0.5
done
[ -n "$URL" ] || { say "the server did not come up in 240 s:"; tail -30 "$OUT/server.log"; exit 4; }
say "server up at $URL: $(grep '^lowbit serve:' "$OUT/server.log")"

# (4) the load client
set -o pipefail
timeout -s INT 170 "$PY" scripts/serve_load.py --url "$URL" --concurrency "$LEVELS" --prompt-tokens "$PROMPT" \
  --max-tokens "$MAXTOK" --timeout-s 120 --deadline-s 140 --bench-json "$BENCH_JSON" --server-command "python3 ${SERVE[*]}" --out-dir "$OUT" \
  2>&1 | tee "$OUT/client.log"
RC=$?
say "client rc $RC; server log tail:"
tail -5 "$OUT/server.log"
exit $RC
