"""End to end through the real caches (issue 6): a random-weight Llama-3-8B-geometry model decoding at 32k.

    PYTHONPATH=src python3 benchmarks/e2e_model.py [--out DIR] [--batches 1,16 --context 32768 --steps 12]

Writes DIR/e2e_model.json (default ./lowbit-results/, rewritten after each row of this run; a file left by an
earlier run is refused, never overwritten). The current result is results/e2e_model_NVIDIA_H200.json.

Model: transformers LlamaForCausalLM built from a LlamaConfig on the GPU in bf16 with its own random
init (32 layers, 32 q / 8 kv heads, head_dim 128, hidden 4096, intermediate 14336, vocab 128256).
Caches: transformers DynamicCache (bf16; model attention "sdpa") and lowbit QuantizedKVCache with the
default "int2" scheme (Hadamard rotation, 2-bit middle tier, bf16 sink 64 + recent 256; attention
"lowbit", decode goes to the fused Triton kernel on CUDA: backend_calls says so).
Context: `context` tokens of random K/V stored through each cache's own update() per layer (the
quantized cache quantizes them with its one quantizer, as prefill would), in chunks; prefill
compute is not what is timed and would only cost device time. Then decode steps through
model.forward (eager, one token per sequence, CUDA-synchronised wall time per step; median).
Capacity: largest batch at 4k/32k/128k whose KV fits in `--budget-gb` from the bytes per token
each cache reports for the tokens it holds (int2: the per-sequence bf16 sink/recent counted as is).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch


def log(*a):
    print(f"[e2e {time.strftime('%H:%M:%S')}]", *a, flush=True)


DEV = "cuda"
GEO = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "vocab_size": 128256}


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 17,
                      rope_theta=500000.0, **GEO)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval(), cfg


def fill(cache, layers, B, L, chunk, quantized: bool):
    """Store L tokens of random K/V [B, 8, L, 128] bf16 per layer through the cache's own update."""
    g = torch.Generator(device=DEV).manual_seed(1)
    for i in range(layers):
        for s in range(0, L, chunk):
            c = min(chunk, L - s)
            k = torch.randn(B, 8, c, 128, device=DEV, dtype=torch.bfloat16, generator=g)
            v = torch.randn(B, 8, c, 128, device=DEV, dtype=torch.bfloat16, generator=g)
            if quantized:
                cache.layers[i].update(k, v)  # the layer's tiers + quantizer (no attention hand-off)
            else:
                cache.update(k, v, i)


def decode(model, cache, B, steps, kwargs_fn):
    ids = torch.randint(0, GEO["vocab_size"], (B, 1), device=DEV)
    times = []
    with torch.no_grad():
        for i in range(steps + 3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(ids, use_cache=True, **kwargs_fn(cache))
            torch.cuda.synchronize()
            if i >= 3:
                times.append((time.perf_counter() - t) * 1e3)
            ids = out.logits[:, -1:].argmax(-1)
            del out
    # device time per step: the kernels' own durations (profiler), so host overhead shows separately
    gpu_ms = None
    if DEV == "cuda":
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                out = model(ids, use_cache=True, **kwargs_fn(cache))
                ids = out.logits[:, -1:].argmax(-1)
                del out
            torch.cuda.synchronize()
        try:
            gpu_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 3 / 1e3
        except Exception:  # noqa: BLE001
            gpu_ms = None
    return statistics.median(times), times, gpu_ms


def dense_bytes(cache) -> int:
    n = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                n += t.numel() * t.element_size()
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="lowbit-results",
                    help="directory for e2e_model.json (default ./lowbit-results)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--budget-gb", type=float, default=100.0)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: 2 small layers")
    a = ap.parse_args()
    path = os.path.join(a.out, "e2e_model.json")
    if os.path.exists(path):
        sys.exit(f"error: {path} exists and results are never overwritten: pass a new directory with --out")
    global DEV
    if a.tiny:
        DEV = "cpu"
        GEO.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=1000)
        torch.cuda.synchronize = lambda: None
        torch.cuda.max_memory_allocated = lambda: 0
        torch.cuda.empty_cache = lambda: None
        torch.cuda.get_device_name = lambda: "cpu"
    import transformers
    from transformers import DynamicCache

    from lowbit.kv import QuantizedKVCache
    from lowbit.kv.cache import cache_kwargs

    os.makedirs(a.out, exist_ok=True)
    res = {"transformers": transformers.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
           "context": a.context, "mode": "eager model.forward, CUDA-synchronised wall time per decode step (median)",
           "fill": "random K/V through each cache's own update() per layer", "rows": []}
    t0 = time.time()
    model, cfg = build_model()
    torch.cuda.synchronize()
    res["model_build_s"] = time.time() - t0
    res["weights_gb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    log(f"model built in {res['model_build_s']:.1f}s, {res['weights_gb']:.1f} GB of weights")
    L = a.context
    for B in (int(x) for x in a.batches.split(",")):
        for kind in ("bf16", "int2"):
            torch.cuda.empty_cache()
            t = time.time()
            if kind == "bf16":
                model.set_attn_implementation("sdpa")
                cache = DynamicCache(config=cfg)
                fill(cache, GEO["num_hidden_layers"], B, L, a.chunk, quantized=False)
            else:
                cache = QuantizedKVCache(model, "int2")  # installs the "lowbit" attention
                fill(cache, GEO["num_hidden_layers"], B, L, a.chunk, quantized=True)
            torch.cuda.synchronize()
            fill_s = time.time() - t
            ms, times, gpu_ms = decode(model, cache, B, a.steps, lambda c: cache_kwargs(model, c))
            row = {"kind": kind, "B": B, "L": L, "ms_per_step": ms, "tok_s": B * 1e3 / ms, "step_ms": times,
                   "gpu_kernel_ms_per_step": gpu_ms,
                   "fill_s": fill_s, "peak_gb": torch.cuda.max_memory_allocated() / 1e9}
            if kind == "bf16":
                kv = dense_bytes(cache)
                row["kv_bytes"] = kv
                row["bytes_per_token"] = kv / (B * cache.get_seq_length())  # all 32 layers
                row["tokens_held"] = cache.get_seq_length()
            else:
                m = cache.memory().to_dict()
                row["kv_bytes"] = m["live_bytes"]
                row["bytes_per_token"] = m["bytes_per_token_per_layer"] * GEO["num_hidden_layers"]
                row["tier_bytes"] = m["bytes"]
                row["tokens_held"] = max(layer.n for layer in cache.layers)
                row["backend_calls"] = dict(cache.backend_calls)
                row["backend_notes"] = cache.backend_notes[:5]
                row["summary"] = cache.summary()
                lm = m["layers"][0]
                row["layer0_tokens"] = lm["tokens"]
                # per-sequence bytes at context n: dense tiers as held + middle bytes/token x the rest
                mid_tok = lm["tokens"]["middle"]
                row["middle_bytes_per_token"] = sum(x["bytes"]["middle_k"] + x["bytes"]["middle_v"]
                                                    for x in m["layers"]) / (B * mid_tok) if mid_tok else None
                row["dense_tier_bytes_per_seq"] = sum(x["bytes"]["sink"] + x["bytes"]["recent"]
                                                      for x in m["layers"]) / B
                row["dense_tier_tokens"] = lm["tokens"]["sink"] + lm["tokens"]["recent"]
            res["rows"].append(row)
            log(f"B{B} L{L} {kind}: {ms:.2f} ms/step (GPU kernels {gpu_ms or 0:.2f} ms), {row['tok_s']:.1f} tok/s, KV {row['kv_bytes'] / 1e9:.2f} GB, "
                f"{row['bytes_per_token']:.0f} B/token (fill {fill_s:.1f}s)" +
                (f" calls {row.get('backend_calls')}" if kind == "int2" else ""))
            del cache
            torch.cuda.empty_cache()
            with open(path, "w") as f:
                json.dump(res, f, indent=1, default=str)
    # capacity in the budget
    cap = {}
    bf = next((r for r in res["rows"] if r["kind"] == "bf16"), None)
    q = next((r for r in res["rows"] if r["kind"] == "int2" and r.get("middle_bytes_per_token")), None)
    budget = a.budget_gb * 1e9
    for n in (4096, 32768, 131072):
        c = {}
        if bf:
            per_seq = bf["bytes_per_token"] * n
            c["bf16_max_batch"] = int(budget // per_seq)
        if q:
            per_seq = q["dense_tier_bytes_per_seq"] + q["middle_bytes_per_token"] * max(0, n - q["dense_tier_tokens"])
            c["int2_max_batch"] = int(budget // per_seq)
        for k in list(c):
            c[k.replace("max_batch", "tokens")] = c[k] * n
        cap[n] = c
    res["capacity_100GB"] = cap
    log("capacity", cap)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
