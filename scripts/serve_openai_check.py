#!/usr/bin/env python3
"""The official `openai` client against `lowbit serve` on loopback: a long-prompt completion, a
streamed chat completion, and 8 concurrent clients compared with the same requests sent alone.

    python scripts/serve_openai_check.py "smollm2-135m --kv int2" results/serve/OUT.json

Starts `python -m lowbit serve ARGS --host 127.0.0.1 --port 0` (scripts/loadtest.py's spawn),
records every answer, usage, the per-response quantized-token count, timings and /metrics.
"""
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import DEFAULT_TEXT, spawn

serve_args = sys.argv[1]
out_path = sys.argv[2]
text = " ".join(DEFAULT_TEXT.read_text(encoding="utf-8").split())
t0 = time.time()
proc, url = spawn(serve_args, 900)
startup = time.time() - t0
rec = {"command": f"python scripts/serve_openai_check.py {serve_args!r} {out_path}",
       "server": f"lowbit serve {serve_args} --host 127.0.0.1 --port 0", "url": url, "startup_s": round(startup, 1)}
try:
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    rec["models"] = [m.model_dump() for m in c.models.list().data]
    cut = text[:2600]
    long_prompt = cut[:cut.rfind(". ") + 1] + "\n\nThe capital of France is"
    t = time.time()
    r = c.completions.create(model="smollm2-135m", prompt=long_prompt, max_tokens=8, temperature=0)
    rec["completion_long_prompt"] = {"prompt_chars": len(long_prompt), "prompt_tail": long_prompt[-60:],
        "text": r.choices[0].text, "usage": r.usage.model_dump(), "lowbit": r.model_extra.get("lowbit"),
        "finish_reason": r.choices[0].finish_reason, "seconds": round(time.time() - t, 2),
        "system_fingerprint": r.system_fingerprint}
    print(rec["completion_long_prompt"], flush=True)
    t = time.time()
    ctx = text[6000:8000]; ctx = ctx[:ctx.rfind(". ") + 1]
    s = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": ctx + "\n\nQuestion: What is the capital of France?"}],
                                  max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, n_chunks, usage, extra = [], 0, None, None
    for ch in s:
        n_chunks += 1
        if ch.choices:
            pieces.append(ch.choices[0].delta.content or "")
        if ch.usage:
            usage, extra = ch.usage.model_dump(), ch.model_extra.get("lowbit")
    rec["chat_stream"] = {"text": "".join(pieces), "chunks": n_chunks, "usage": usage, "lowbit": extra,
                          "seconds": round(time.time() - t, 2)}
    print(rec["chat_stream"], flush=True)
    questions = ["France", "Italy", "Germany", "Spain", "Japan", "England", "Russia", "Egypt"]
    def ask(i, stream):
        p = text[3000 + 500 * i: 3000 + 500 * i + 1800]
        p = p[:p.rfind(". ") + 1] + f"\n\nThe capital of {questions[i]} is"
        if stream:
            return "".join(ch.choices[0].text for ch in c.completions.create(model="smollm2-135m", prompt=p, max_tokens=6, temperature=0, stream=True))
        return c.completions.create(model="smollm2-135m", prompt=p, max_tokens=6, temperature=0).choices[0].text
    t = time.time()
    alone = [ask(i, False) for i in range(8)]
    t_alone = time.time() - t
    t = time.time()
    with ThreadPoolExecutor(8) as pool:
        conc = list(pool.map(lambda i: ask(i, i % 2 == 0), range(8)))
    t_conc = time.time() - t
    rec["concurrent_8"] = {"alone": alone, "concurrent": conc, "all_equal": alone == conc,
                           "seconds_sequential": round(t_alone, 1), "seconds_concurrent": round(t_conc, 1)}
    print(rec["concurrent_8"], flush=True)
    rec["metrics_after"] = json.loads(urllib.request.urlopen(url + "/metrics").read())
finally:
    proc.terminate()
    proc.wait(30)
Path(out_path).write_text(json.dumps(rec, indent=2) + "\n")
print("wrote", out_path)
