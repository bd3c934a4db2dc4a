"""Single-request decode speed, vLLM's own attention vs the lowbit plugin, with a protocol for a shared machine:
both servers up at once (same flags as scripts/vllm_throughput.py --probe-only), then the same probe sent to
one and the other in turn, --rounds times (A B A B ...), so adjacent probes see about the same load.

    /work/vllm-venv/bin/python scripts/vllm_decode_ab.py --model smollm2-135m \\
        --recipe auto=/root/.cache/lowbit/smollm2-135m --recipe int4=/tmp/i21/exp/smollm2-int4-default \\
        --kv-budget-bytes 60000000 --probe-tokens 2048 --probe-max-tokens 48 --max-model-len 2176 \\
        --enforce-eager --rounds 6 --out benchmarks/results/serve/vllm_decode_probe_<model>_<tag>.json

Per probe: decode tok/s (1 / mean ITL, as vllm_throughput.py), ITL p50, the 1-minute load average before and
after. Summary: per-recipe medians, the ratio of the medians (second recipe / first), and the ratio of every
adjacent pair (each probe of the second recipe against the first recipe's probe just before and just after it).
The idle server waits on its queue while the other one runs; the servers are always stopped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _vt():
    spec = importlib.util.spec_from_file_location("vllm_throughput", Path(__file__).with_name("vllm_throughput.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def summary(runs: list[dict], a: str, b: str) -> dict:
    """Medians per recipe, ratio b/a of the medians, and b's probe against each adjacent a probe."""
    tok = {r: [x["decode_tok_s_per_request"] for x in runs if x["recipe"] == r] for r in (a, b)}
    pairs = []
    for i, x in enumerate(runs):
        if x["recipe"] != b:
            continue
        for j in (i - 1, i + 1):
            if 0 <= j < len(runs) and runs[j]["recipe"] == a:
                pairs.append({"probes": [j, i], "ratio": round(x["decode_tok_s_per_request"]
                                                                / runs[j]["decode_tok_s_per_request"], 3)})
    med = {r: round(statistics.median(v), 2) for r, v in tok.items() if v}
    out = {"median_tok_s": med, "pairs": pairs}
    if len(med) == 2:
        out["ratio_of_medians"] = round(med[b] / med[a], 3)
    if pairs:
        out["median_pair_ratio"] = round(statistics.median(p["ratio"] for p in pairs), 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--recipe", action="append", required=True, metavar="NAME=DIR", help="exactly two: A then B")
    ap.add_argument("--kv-budget-bytes", type=int, required=True)
    ap.add_argument("--probe-tokens", type=int, default=2048)
    ap.add_argument("--probe-max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2176)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"))
    ap.add_argument("--port", type=int, default=8795, help="A's port; B's is the next one")
    ap.add_argument("--startup-timeout", type=float, default=1500)
    ap.add_argument("--request-timeout", type=float, default=1800)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    recipes = []
    for spec in args.recipe:
        name, _, d = spec.partition("=")
        if not d or not (Path(d) / "config.json").is_file():
            raise SystemExit(f"error: --recipe {spec}: NAME=DIR with a model directory (config.json)")
        recipes.append((name, str(Path(d).resolve())))
    if len(recipes) != 2 or recipes[0][0] == recipes[1][0]:
        raise SystemExit("error: give exactly two --recipe NAME=DIR with different names (A, then B)")
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"error: {out} exists; pick a new --out (earlier results are kept)")
    vt = _vt()
    import torch
    import vllm

    env = {"vllm": vllm.__version__, "torch": torch.__version__, "cpus": os.cpu_count(), "model": args.model,
           "dtype": args.dtype, "kv_budget_bytes": args.kv_budget_bytes, "probe_tokens": args.probe_tokens,
           "probe_max_tokens": args.probe_max_tokens, "max_model_len": args.max_model_len, "prefix_caching": False,
           "enforce_eager": args.enforce_eager, "protocol": "both servers up; probes alternate A, B per round",
           "recipes": dict(recipes), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
           "load_average_start": os.getloadavg()}
    ids = vt._prompt_ids(recipes[0][1], args.probe_tokens, args.text)
    vt_args = argparse.Namespace(dtype=args.dtype, kv_budget_bytes=args.kv_budget_bytes, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager)
    runs: list[dict] = []

    def save():
        a, b = recipes[0][0], recipes[1][0]
        out.write_text(json.dumps({"env": env, "runs": runs, "summary": summary(runs, a, b)}, indent=2) + "\n")

    procs, logs = [], []
    try:
        for i, (name, d) in enumerate(recipes):
            log = Path(tempfile.mkstemp(prefix=f"vllm-ab-{name}-", suffix=".log")[1])
            print(f"[{name}] starting vLLM for {d} on port {args.port + i} (log {log})", file=sys.stderr, flush=True)
            procs.append(vt._serve(sys.executable, d, args.port + i, vt_args, log, args.max_model_len))
            logs.append(log)
        for i, (name, _) in enumerate(recipes):
            s = vt._wait(args.port + i, procs[i], logs[i], args.startup_timeout)
            print(f"[{name}] up after {s:.0f} s", file=sys.stderr, flush=True)
            vt._level(args.port + i, ids[:16], 1, 4, args.request_timeout)  # warm-up
        env["plugin_log"] = {name: sorted({l.split("lowbit plugin: ", 1)[1] for l in logs[i].read_text().splitlines()
                                          if "lowbit plugin: " in l}) for i, (name, _) in enumerate(recipes)}
        for rnd in range(args.rounds):
            for i, (name, _) in enumerate(recipes):
                la0 = os.getloadavg()[0]
                t0 = time.strftime("%H:%M:%S")
                r = vt._level(args.port + i, ids[: args.probe_tokens], 1, args.probe_max_tokens, args.request_timeout)
                runs.append({"probe": len(runs), "round": rnd, "recipe": name, "time": t0, "load_average_before": round(la0, 2),
                             **{k: r[k] for k in ("decode_tok_s_per_request", "itl_p50_ms", "itl_mean_ms", "itl_p99_ms",
                                                  "ttft_p50_s", "load_average_1m")}})
                save()
                print(f"[{name}] round {rnd}: {runs[-1]}", file=sys.stderr, flush=True)
    finally:
        for p in procs:
            vt._stop(p)
    env["load_average_end"] = os.getloadavg()
    save()
    print(json.dumps(summary(runs, recipes[0][0], recipes[1][0]), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
