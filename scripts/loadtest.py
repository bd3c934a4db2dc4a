#!/usr/bin/env python3
"""Bounded load test of `lowbit serve` (or any OpenAI-compatible server) on loopback.

    python scripts/loadtest.py --serve "--model smollm2-135m --kv int2" --concurrency 1,4,16 \
        --out results/serve/loadtest_smollm2-135m-int2_cpu.json
    python scripts/loadtest.py --url http://127.0.0.1:8000 --model smollm2-135m

For each concurrency level C, C client threads take max(C, --min-requests) non-streaming
/v1/completions requests from a shared list, each sending its next as soon as the last returns
(greedy, fixed max_tokens, prompts cut from WikiText at different offsets). Reported per level: requests/s, latency p50/p95/max, completion tokens/s,
errors; plus the server's /v1/models card and its /metrics after each level.

Bounded: the number of requests is fixed, each request has a timeout, the whole run has a
deadline (--deadline-s) after which no new request starts. Only loopback URLs are accepted.
`--serve ARGS` starts `python -m lowbit serve ARGS --port 0` itself and stops it at the end.
Standard library only (urllib, threads), so the client adds little overhead of its own.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
MAX_REQUESTS = 256


def _loopback(url: str) -> str:
    host = urllib.parse.urlparse(url).hostname or ""
    if host == "localhost":
        return url
    try:
        if ipaddress.ip_address(host).is_loopback:
            return url
    except ValueError:
        pass
    raise SystemExit(f"error: {url} is not a loopback address; this load test only targets 127.0.0.0/8 or ::1")


def _http(url: str, body: dict | None = None, timeout: float = 300.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _prompts(text_path: Path | None, n: int, chars: int) -> list[str]:
    if text_path is not None and text_path.is_file():
        text = " ".join(text_path.read_text(encoding="utf-8").split())
    else:  # no corpus: a varied synthetic text
        text = " ".join(f"Sentence {i} talks about item {i * 7 % 13} and place {i % 5}." for i in range(4000))
    step = max(1, (len(text) - chars) // max(n, 1))
    return [text[i * step:i * step + chars] for i in range(n)]


def run_level(url: str, model: str, prompts: list[str], concurrency: int, n_requests: int, max_tokens: int,
              deadline: float, timeout: float) -> dict:
    lat, toks, errors = [], [], []
    lock = threading.Lock()
    todo = list(range(n_requests))

    def client(c: int):
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            if time.time() > deadline:
                with lock:
                    errors.append("deadline: not sent")
                continue
            p = prompts[i % len(prompts)]
            t0 = time.perf_counter()
            try:
                status, body = _http(url + "/v1/completions", {"model": model, "prompt": p, "max_tokens": max_tokens,
                                                               "temperature": 0}, timeout)
            except OSError as e:
                status, body = 0, {"error": {"message": str(e)}}
            dt = time.perf_counter() - t0
            with lock:
                if status == 200:
                    lat.append(dt)
                    toks.append(body["usage"]["completion_tokens"])
                else:
                    errors.append(f"{status}: {body.get('error', {}).get('message', body)}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": n_requests,
        "ok": len(lat),
        "errors": len(errors),
        "error_samples": errors[:3],
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(lat) / wall, 4),
        "latency_s": {"p50": _r(_percentile(lat, 0.5)), "p95": _r(_percentile(lat, 0.95)), "max": _r(max(lat, default=None)),
                      "mean": _r(sum(lat) / len(lat) if lat else None)},
        "completion_tokens": sum(toks),
        "completion_tokens_per_s": round(sum(toks) / wall, 3),
    }


def _r(x):
    return None if x is None else round(x, 4)


def spawn(serve_args: str, startup_timeout: float) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "lowbit", "serve", *shlex.split(serve_args), "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    lines = []
    while time.time() - t0 < startup_timeout:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise SystemExit("error: lowbit serve exited:\n" + "".join(lines))
            continue
        lines.append(line)
        print("  server:", line.rstrip(), file=sys.stderr)
        if line.startswith("listening on "):
            url = line.split()[2]
            # keep draining the server's output so it never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, url
    proc.terminate()
    raise SystemExit("error: lowbit serve did not start in time")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="base URL of a running server on loopback, e.g. http://127.0.0.1:8000")
    src.add_argument("--serve", metavar="ARGS", help='start `lowbit serve ARGS` (e.g. "--model smollm2-135m --kv int2")')
    ap.add_argument("--model", default=None, help="model id to send (default: the server's only model)")
    ap.add_argument("--concurrency", default="1,4,16", help="comma list of client counts (default 1,4,16)")
    ap.add_argument("--min-requests", type=int, default=4,
                    help="requests per level: max(concurrency, this) (default 4)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-chars", type=int, default=1600, help="characters of text per prompt (default 1600)")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="text the prompts are cut from (WikiText-2 test)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    ap.add_argument("--deadline-s", type=float, default=1800.0, help="no request starts after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    counts = [max(c, args.min_requests) for c in levels]
    if any(c < 1 for c in levels) or sum(counts) > MAX_REQUESTS:
        raise SystemExit(f"error: concurrency levels must be >= 1 and send at most {MAX_REQUESTS} requests in all")
    proc = None
    if args.serve:
        proc, url = spawn(args.serve, 900)
    else:
        url = args.url.rstrip("/")
    _loopback(url)
    try:
        status, models = _http(url + "/v1/models")
        if status != 200:
            raise SystemExit(f"error: {url}/v1/models answered {status}")
        card = models["data"][0]
        model = args.model or card["id"]
        prompts = _prompts(args.text, max(counts) + 1, args.prompt_chars)
        # one warm-up request so the first level does not pay for lazy initialisation
        _http(url + "/v1/completions", {"model": model, "prompt": prompts[0], "max_tokens": 2, "temperature": 0},
              args.timeout_s)
        deadline = time.time() + args.deadline_s
        results = []
        for c, n in zip(levels, counts):
            r = run_level(url, model, prompts[1:], c, n, args.max_tokens, deadline, args.timeout_s)
            r["server_metrics"] = _http(url + "/metrics")[1]
            r["loadavg_1m_after"] = round(os.getloadavg()[0], 2)  # other work on the machine skews the times
            results.append(r)
            print(f"c={c:3d}  {r['ok']}/{r['requests']} ok  {r['requests_per_s']:.3f} req/s  "
                  f"p50 {r['latency_s']['p50']} s  p95 {r['latency_s']['p95']} s  "
                  f"{r['completion_tokens_per_s']:.2f} tok/s", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    out = {
        "what": "lowbit serve load test: non-streaming /v1/completions, greedy, loopback",
        "server": {"url": url, "model": model, "card": card, "spawned_with": args.serve},
        "params": {"min_requests": args.min_requests, "max_tokens": args.max_tokens,
                   "prompt_chars": args.prompt_chars, "text": str(args.text)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "note": "CPU shared with other work while measured"},
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "levels": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(r["errors"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
