"""Why the fused decode kernel is slower inside the runtime step than in `lowbit bench decode-attention`.

Builds the runtime's StaticKVCache (random-weight geometry, B slots, L random tokens written through the
codec, as `lowbit bench decode` fills it) and times the fused kernel with the cache's own tensors, one
variant per line (CUDA events over graph replays of 32 calls, median of 5):
    step-layer0      layer 0's tensors as the step passes them, 32 calls
    step-all-layers  each of the 32 layers once (what one decode step reads)
    contiguous       layer 0's tiers cloned to exactly C rows
    middle-only      layer 0 without the sink / recent tiers
    splits=N         layer 0 with num_splits forced
--sweep: instead, layer 0 with the dense tiers over launch configs (num_warps, warp_tokens, dense_block,
num_splits; "auto" = the kernel's own split pick), the ms of each and the best.
Usage (CUDA): python3 benchmarks/kernel_in_step_probe.py --batch 16 --length 32768 [--sweep] --out probe.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from lowbit.kernels.attention.tiers import KernelConfig, decode_attention
from lowbit.kv.plan import resolve
from lowbit.models.geometry import ModelGeometry
from lowbit.models.random import GEOMETRIES
from lowbit.tools.bench.runtime import _fill_static
from lowbit.runtime.static_cache import StaticKVCache


def _args(layer, B, C, S, R, L, *, contiguous=False, dense=True):
    mk, mv = layer.mid["k"], layer.mid["v"]
    mid = [mk["codes"][:B, :, :C], mk["scale"][:B, :, :C], mk["zero"][:B, :, :C],
           mv["codes"][:B, :, :C], mv["scale"][:B, :, :C], mv["zero"][:B, :, :C]]
    if contiguous:
        mid = [t.contiguous() for t in mid]
    dev = mid[0].device
    n_mid = torch.full((B,), max(0, L - S - R), dtype=torch.int32, device=dev)
    kw = {"mid_lens": n_mid}
    if dense:
        kw.update(recent_k=layer.ring_k[:B, :, :R], recent_v=layer.ring_v[:B, :, :R],
                  recent_lens=torch.full((B,), R, dtype=torch.int32, device=dev))
        if S:
            kw.update(sink_k=layer.sink_k[:B, :, :S], sink_v=layer.sink_v[:B, :, :S],
                      sink_lens=torch.full((B,), S, dtype=torch.int32, device=dev))
    return mid, kw


def _time(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    out = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="llama3-8b")
    ap.add_argument("--kv", default="int2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    from transformers import LlamaConfig

    cfg = LlamaConfig(**GEOMETRIES[a.geometry])
    cfg.torch_dtype = torch.bfloat16
    geo = ModelGeometry.from_config(cfg, name="random-llama")
    plan = resolve(a.kv, geo, device="cuda")
    B, L = a.batch, a.length
    cache = StaticKVCache(cfg, plan, slots=B, max_context=L + 64, device="cuda", dtype=torch.bfloat16)
    _fill_static(cache, L, torch.Generator(device="cuda").manual_seed(1))
    layers = cache.layers
    l0 = layers[0]
    C, S, R = l0.C, l0.S, l0.R
    Hq = cfg.num_attention_heads
    q = torch.randn(B, Hq, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    kb, vb = l0.k_codec.cbits, l0.v_codec.cbits
    bytes_layer = sum(t.numel() * t.element_size() for t in _args(l0, B, C, S, R, L)[0]) * (L - S - R) / max(C, 1)
    rows = []

    def run(name, fn, calls, nbytes):
        ms = _time(fn)
        per = ms / calls
        rows.append({"variant": name, "ms_per_call": per, "tb_s": nbytes / per / 1e9})
        print(f"{name:18s} {per * 1e3:8.1f} us/call  {nbytes / per / 1e9:6.2f} TB/s", flush=True)

    mid, kw = _args(l0, B, C, S, R, L)
    _, launch = decode_attention(q, *mid, k_bits=kb, v_bits=vb, return_launch=True, **kw)
    print(f"C={C} S={S} R={R} launch={launch}", flush=True)
    if a.sweep:
        _sweep(a, run, q, mid, kw, kb, vb, bytes_layer, B)
        rows.sort(key=lambda r: r["ms_per_call"])
        print("best:", rows[0], flush=True)
    else:
        _variants(run, q, mid, kw, kb, vb, bytes_layer, layers, l0, B, C, S, R, L)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__},
                       "B": B, "L": L, "kv": a.kv, "C": C, "S": S, "R": R, "launch": str(launch), "rows": rows}, f,
                      indent=1)


def _sweep(a, run, q, mid, kw, kb, vb, nbytes, B):
    shapes = [(1, 64), (2, 32), (2, 64), (4, 32), (4, 16)] if B * 8 < 64 else [(1, 64), (2, 32), (4, 32)]
    splits = [None, 48, 64, 96, 128] if B * 8 < 64 else [None, 3, 4, 5, 6, 8, 11, 12]
    for nw, wt in shapes:
        for db in (32, 128):
            for n in splits:
                c = KernelConfig(num_warps=nw, warp_tokens=wt, dense_block=db, num_splits=n)
                name = f"w{nw} t{wt} d{db} s{n or 'auto'}"
                try:
                    run(name, lambda c=c: [decode_attention(q, *mid, k_bits=kb, v_bits=vb, config=c, **kw)
                                           for _ in range(32)], 32, nbytes)
                except Exception as e:  # noqa: BLE001 -- a config that does not compile: say so, go on
                    print(f"{name}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)


def _variants(run, q, mid, kw, kb, vb, bytes_layer, layers, l0, B, C, S, R, L):
    run("step-layer0", lambda: [decode_attention(q, *mid, k_bits=kb, v_bits=vb, **kw) for _ in range(32)], 32,
        bytes_layer)
    per_layer = [_args(ly, B, C, S, R, L) for ly in layers]
    run("step-all-layers", lambda: [decode_attention(q, *m, k_bits=kb, v_bits=vb, **k) for m, k in per_layer],
        len(layers), bytes_layer)
    cm, ckw = _args(l0, B, C, S, R, L, contiguous=True)
    run("contiguous", lambda: [decode_attention(q, *cm, k_bits=kb, v_bits=vb, **ckw) for _ in range(32)], 32,
        bytes_layer)
    om, okw = _args(l0, B, C, S, R, L, dense=False)
    run("middle-only", lambda: [decode_attention(q, *om, k_bits=kb, v_bits=vb, **okw) for _ in range(32)], 32,
        bytes_layer)
    for n in (1, 2, 3, 4, 6, 8, 12, 16):
        c = KernelConfig(num_splits=n)
        run(f"splits={n}", lambda c=c: [decode_attention(q, *mid, k_bits=kb, v_bits=vb, config=c, **kw)
                                        for _ in range(32)], 32, bytes_layer)


if __name__ == "__main__":
    main()
