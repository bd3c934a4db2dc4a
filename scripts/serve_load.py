#!/usr/bin/env python3
"""Streaming load test of a running `lowbit serve` through the official `openai` client.

    python scripts/serve_load.py --url http://127.0.0.1:8000 --concurrency 1,8,32 --prompt-tokens 4096 \
        --max-tokens 512 --bench-json decode_b32.json --out-dir OUT

Meant for a server of `--model random:GEOMETRY` (a word tokenizer: "t17" is token 17, no EOS), so a prompt of
N words is N tokens and every request runs to exactly --max-tokens. scripts/serve_load_gpu.sh starts the
server, runs this, and stops the server.

Per level C: C threads, each with its own openai.OpenAI client, released together by a barrier, each sending
one streamed /v1/completions request (greedy, its own random prompt of --prompt-tokens words, stream_options
include_usage). Every content chunk is stamped on arrival (perf_counter). Reported per level:
  aggregate_tok_s         all completion tokens / wall time of the level (prefills included)
  aggregate_decode_tok_s  tokens that arrived while all C streams were decoding (after the last stream's first
                          token, up to the first stream's last token) / that window: what the captured batch-C
                          decode step sustains through HTTP, comparable to the `lowbit bench decode` row at B=C
  ttft_ms                 send -> first content chunk, p50 / p99 / max
  itl_ms, itl_steady_ms   gaps between a stream's consecutive chunks, p50 / p99 (all; inside the window)
and the server's /metrics after the level. With --bench-json (a `lowbit bench decode` result) the row at B =
the largest level is copied in, with the ratio aggregate_decode_tok_s / bench tok_s (target >= 0.8).
Bounded: loopback URLs only (scripts/loadtest.py's check), a per-request timeout, a deadline for the run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import platform
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadtest  # scripts/loadtest.py: loopback check, percentiles, plain HTTP GETs)

TARGET_RATIO = 0.8
PACKAGES = ("torch", "transformers", "triton", "fastapi", "starlette", "uvicorn", "pydantic", "openai", "httpx2",
            "anyio")


def _ms(xs: list[float], q: float) -> float | None:
    v = loadtest._percentile(xs, q)
    return None if v is None else round(1e3 * v, 3)


def _words(g: random.Random, n: int, vocab: int) -> str:
    """n random word tokens ("t0".."t{vocab-1}"), one token each under the random model's word tokenizer."""
    return " ".join(f"t{g.randrange(vocab)}" for _ in range(n))


def stream_one(client, model: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One streamed completion: send time, arrival time of every non-empty chunk, usage, finish reason."""
    t0 = time.perf_counter()
    stamps, usage, finish = [], None, None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True}, timeout=timeout)
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            c = chunk.choices[0]
            if c.text:
                stamps.append(now)
            finish = c.finish_reason or finish
        if chunk.usage is not None:
            usage = {"prompt_tokens": chunk.usage.prompt_tokens, "completion_tokens": chunk.usage.completion_tokens}
    return {"t0": t0, "stamps": stamps, "usage": usage, "finish_reason": finish}


def run_level(url: str, model: str, prompts: list[str], max_tokens: int, timeout: float, deadline: float) -> dict:
    import openai

    C = len(prompts)
    results: list[dict | None] = [None] * C
    errors: list[str] = []
    barrier = threading.Barrier(C)
    lock = threading.Lock()

    def client(i: int):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)
        barrier.wait()
        if time.time() > deadline:
            with lock:
                errors.append("deadline: not sent")
            return
        try:
            results[i] = stream_one(c, model, prompts[i], max_tokens, timeout)
        except Exception as e:  # noqa: BLE001 -- an error is a result of the level, not the end of the run
            with lock:
                errors.append(f"{type(e).__name__}: {str(e)[:200]}")
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(C)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if r is not None and r["stamps"]]
    if not ok:
        return {"concurrency": C, "requests": C, "ok": 0, "errors": len(errors) or C, "error_samples": errors[:3]}
    t_first_send = min(r["t0"] for r in ok)
    t_end = max(r["stamps"][-1] for r in ok)
    wall = t_end - t_first_send
    tokens = sum(len(r["stamps"]) for r in ok)
    ttft = [r["stamps"][0] - r["t0"] for r in ok]
    itl = [b - a for r in ok for a, b in itertools.pairwise(r["stamps"])]
    all_in = max(r["stamps"][0] for r in ok)  # every stream is decoding from here ...
    first_out = min(r["stamps"][-1] for r in ok)  # ... until the first one ends
    window = first_out - all_in
    steady = sum(1 for r in ok for t in r["stamps"] if all_in < t <= first_out)
    itl_steady = [b - a for r in ok for a, b in itertools.pairwise(r["stamps"]) if all_in < a and b <= first_out]
    usage_ok = all(r["usage"] and r["usage"]["completion_tokens"] == len(r["stamps"]) == max_tokens for r in ok)
    return {
        "concurrency": C, "requests": C, "ok": len(ok), "errors": C - len(ok),
        "error_samples": errors[:3],
        "prompt_tokens": sorted({r["usage"]["prompt_tokens"] for r in ok if r["usage"]}),
        "max_tokens": max_tokens, "completion_tokens": tokens,
        "one_chunk_per_token": usage_ok,  # usage.completion_tokens == chunks == max_tokens for every stream
        "finish_reasons": sorted({str(r["finish_reason"]) for r in ok}),
        "wall_s": round(wall, 4),
        "aggregate_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "aggregate_decode_tok_s": round(steady / window, 2) if window > 0 and steady else None,
        "steady_window_s": round(window, 4), "steady_tokens": steady,
        "steady_note": None if window > 0 and steady else
        "no window: a stream ended before the last stream's first token (raise --max-tokens)",
        "ttft_ms": {"p50": _ms(ttft, 0.5), "p99": _ms(ttft, 0.99), "max": round(1e3 * max(ttft), 3)},
        "itl_ms": {"p50": _ms(itl, 0.5), "p99": _ms(itl, 0.99), "max": round(1e3 * max(itl), 3) if itl else None},
        "itl_steady_ms": {"p50": _ms(itl_steady, 0.5), "p99": _ms(itl_steady, 0.99)},
    }


def _busy_s(metrics: dict) -> float:
    """Seconds the server's worker spent in forward passes so far (generated tokens / tokens per busy second)."""
    t = metrics.get("tokens", {})
    return t["generated_total"] / t["per_s_busy"] if t.get("per_s_busy") else 0.0


def _gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], check=False,
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def env_block(bench: dict | None) -> dict:
    versions = {}
    for p in PACKAGES:
        try:
            versions[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            versions[p] = None
    gpu = (bench or {}).get("env", {}).get("gpu") or _gpu_name()
    return {"gpu": gpu, "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "packages": versions, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def bench_row(path: Path | None, B: int) -> tuple[dict | None, str | None]:
    """The `lowbit bench decode` row at batch B (lowbit-int2 preferred), trimmed; or (None, why not)."""
    if path is None:
        return None, "no --bench-json given"
    if not path.is_file():
        return None, f"{path} was not written (the bench step failed or did not run: see its log)"
    d = json.loads(path.read_text())
    rows = [r for r in d.get("rows", []) if r.get("B") == B and r.get("fits")]
    rows.sort(key=lambda r: r["path"] != "lowbit-int2")
    if not rows:
        return None, f"{path} has no fitting row at B={B}"
    keep = ("path", "B", "L", "ms_per_step", "tok_s", "gpu_ms_per_step", "kv_bytes", "capture_s", "attention")
    return {k: rows[0].get(k) for k in keep} | {"env": d.get("env")}, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="base URL of a running `lowbit serve` on loopback")
    ap.add_argument("--concurrency", default="1,8,32", help="comma list of concurrent streams (default 1,8,32)")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="words (= tokens) per prompt (default 4096)")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens per request, all of them generated")
    ap.add_argument("--vocab", type=int, default=1000, help="prompt words are t0..t{vocab-1} (default 1000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout")
    ap.add_argument("--deadline-s", type=float, default=240.0, help="no level starts (or request is sent) after this")
    ap.add_argument("--ready-timeout-s", type=float, default=60.0, help="wait this long for /health")
    ap.add_argument("--bench-json", type=Path, default=None, help="a `lowbit bench decode` result (the B row)")
    ap.add_argument("--server-command", default=None, help="recorded in the JSON: how the server was started")
    ap.add_argument("--out-dir", type=Path, required=True, help="writes serve_load_<gpu>.json here")
    args = ap.parse_args(argv)

    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not levels or any(c < 1 or c > 256 for c in levels):
        raise SystemExit("error: concurrency levels must be 1..256")
    url = loadtest._loopback(args.url.rstrip("/"))
    t_start = time.time()
    deadline = t_start + args.deadline_s
    while True:  # the socket listens from the start; /health answers once uvicorn runs
        try:
            if loadtest._http(url + "/health", timeout=10)[0] == 200:
                break
        except OSError:
            pass
        if time.time() - t_start > args.ready_timeout_s:
            raise SystemExit(f"error: {url}/health did not answer 200 within {args.ready_timeout_s} s")
        time.sleep(0.5)
    card = loadtest._http(url + "/v1/models")[1]["data"][0]
    model = card["id"]
    g = random.Random(args.seed)
    # warm-up: one request of the full prompt length (both prefill paths: first chunk, chunk over history)
    warm = run_level(url, model, [_words(g, args.prompt_tokens, args.vocab)], 8, args.timeout_s, deadline)
    print(f"warm-up: {warm.get('ok')}/1 ok, TTFT {warm.get('ttft_ms')}", flush=True)
    results = []
    for C in levels:
        if time.time() > deadline:
            results.append({"concurrency": C, "skipped": "deadline"})
            continue
        prompts = [_words(g, args.prompt_tokens, args.vocab) for _ in range(C)]
        before = loadtest._http(url + "/metrics")[1]
        r = run_level(url, model, prompts, args.max_tokens, args.timeout_s, deadline)
        r["server_metrics"] = loadtest._http(url + "/metrics")[1]
        busy = _busy_s(r["server_metrics"]) - _busy_s(before)
        # the worker's time inside prefill chunks and decode steps over the level's wall time: the rest is
        # host work between steps (sampling, detokenizing, streaming, scheduling) or idle
        r["server_busy_s"] = round(busy, 4)
        r["server_busy_fraction"] = round(busy / r["wall_s"], 4) if r.get("wall_s") else None
        r["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
        results.append(r)
        print(f"C={C:3d} {r['ok']}/{C} ok  aggregate {r.get('aggregate_tok_s')} tok/s  decode "
              f"{r.get('aggregate_decode_tok_s')} tok/s (window {r.get('steady_window_s')} s)  TTFT p50/p99 "
              f"{(r.get('ttft_ms') or {}).get('p50')}/{(r.get('ttft_ms') or {}).get('p99')} ms  ITL p50/p99 "
              f"{(r.get('itl_ms') or {}).get('p50')}/{(r.get('itl_ms') or {}).get('p99')} ms  server busy "
              f"{r.get('server_busy_fraction')}", flush=True)
    B = max(levels)
    ref, why = bench_row(args.bench_json, B)
    top = next((r for r in results if r.get("concurrency") == B and r.get("aggregate_decode_tok_s")), None)
    target = {"level": B, "serve_decode_tok_s": top and top["aggregate_decode_tok_s"],
              "bench_tok_s": ref and ref["tok_s"], "target_ratio": TARGET_RATIO, "ratio": None, "met": None}
    if top and ref and ref.get("tok_s"):
        target["ratio"] = round(top["aggregate_decode_tok_s"] / ref["tok_s"], 4)
        target["met"] = target["ratio"] >= TARGET_RATIO
    if why:
        target["note"] = why
    env = env_block(ref)
    tag = re.sub(r"[^A-Za-z0-9._-]+", "_", (env["gpu"] or "cpu").strip()) or "cpu"
    out = {
        "what": "lowbit serve streaming load test: official openai client, /v1/completions stream=True, greedy, "
                "fixed output length, one burst of C streams per level, loopback",
        "env": env,
        "definitions": {
            "aggregate_tok_s": "completion tokens of all C streams / (first send .. last token), prefills included",
            "aggregate_decode_tok_s": "tokens arriving after the last stream's first token and up to the first "
                                      "stream's last token (all C decoding) / that window; compared with the bench row",
            "ttft_ms": "send -> first content chunk, per stream", "itl_ms": "gaps between a stream's chunks",
            "itl_steady_ms": "those gaps inside the window",
            "server_busy_fraction": "the server worker's time in prefill chunks and decode steps (its /metrics) / "
                                    "wall_s: the rest is host work between steps or idle"},
        "server": {"url": url, "model": model, "card": card, "command": args.server_command},
        "params": {"concurrency": levels, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                   "vocab": args.vocab, "seed": args.seed, "timeout_s": args.timeout_s},
        "warmup": {k: warm.get(k) for k in ("ok", "ttft_ms", "errors", "error_samples")},
        "levels": results,
        "decode_benchmark": ref,
        "target": target,
        "run_s": round(time.time() - t_start, 2),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"serve_load_{tag}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"target: {json.dumps(target)}\nwrote {path}", flush=True)
    return 0 if all(r.get("ok") == r.get("requests") and not r.get("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
