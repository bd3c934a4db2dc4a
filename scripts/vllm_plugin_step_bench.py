"""Time the vLLM plugin's decode step per layer without vLLM: the calls LowbitAttentionImpl makes
(do_kv_cache_update -> paged.write, forward -> paged.attend, output copy) and the builder's once-per-step
retain, over L layers sharing one step's metadata memo, on one request with a `--context`-token history.

    .venv/bin/python scripts/vllm_plugin_step_bench.py --export /tmp/i21/exp/smollm2-int4-default \\
        --context 2048 --layers 30 --steps 40 [--profile]

Geometry, scheme and rotations come from the export's sidecar (as the backend reads them); K/V/q are
random bf16. Block size 128 (vLLM's CPU default), blocks scrambled. Prints the median / p10 ms per
layer-step of: write, attend, and the whole layer (write + attend + output copy), and with --profile
the top aten ops of one step (torch.profiler). Single thread unless --threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _model(export: str, dtype: torch.dtype):
    from transformers import AutoConfig

    from lowbit.kv.plan import resolve
    from lowbit.models.geometry import ModelGeometry
    from lowbit.vllm_plugin import sidecar
    from lowbit.vllm_plugin.slot import layer_formats

    p = Path(export)
    side = sidecar.read(p)
    geometry = ModelGeometry.from_config(AutoConfig.from_pretrained(p), name=side["model"]["name"])
    plan = resolve(sidecar.scheme_of(side, p), geometry, device="cpu")
    return plan, geometry, layer_formats(plan, dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-fast-encode", action="store_true",
                    help="every write through TensorCodec.encode (slot.FAST_ROWS = 0), to time the C++ encoder's share")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    import inspect

    from lowbit.vllm_plugin import cpu_kernel, paged

    WRITE_MEMO = "memo" in inspect.signature(paged.write).parameters  # the same script times older trees
    if args.no_fast_encode:
        from lowbit.vllm_plugin import slot

        slot.FAST_ROWS = 0

    plan, geometry, fmts = _model(args.export, dtype)
    kernel = "cpu-fused" if cpu_kernel.load()[0] is not None else "torch"
    g = geometry.layers[0]
    Hkv, Hq, D = g.num_kv_heads, g.num_q_heads, g.head_dim_k
    L, bs, n0 = min(args.layers, len(plan.layers)), args.block_size, args.context
    sch = plan.scheme
    total = n0 + args.steps + 8
    nbt = -(-total // bs)
    nblocks = nbt + 5
    table = torch.randperm(nblocks)[:nbt][None].to(torch.int32)
    caches, arenas = [], []
    for i in range(L):  # the history, written as a prefill would (one chunk)
        f = fmts[i]
        c = torch.zeros(nblocks, Hkv, bs, f.slot_bytes, dtype=torch.uint8)
        a = paged.TierArena(sch.sink, sch.recent, bs, dtype) if sch.sink or sch.recent else None
        pos = torch.arange(n0)
        slots = table[0].long()[pos // bs] * bs + pos % bs
        paged.write(c, f, torch.randn(n0, Hkv, D).to(dtype), torch.randn(n0, Hkv, D).to(dtype), slots,
                    plan.layers[i].rot_k, plan.layers[i].rot_v, positions=pos, row_seq_lens=torch.full((n0,), n0),
                    arena=a)
        caches.append(c)
        arenas.append(a)
    scale = D ** -0.5
    t_w, t_a, t_l = [], [], []

    def step(n_hist: int, record: bool):
        seq = n_hist + 1
        qsl = torch.tensor([0, 1], dtype=torch.int32)
        seq_lens = torch.tensor([seq], dtype=torch.int32)
        slot_mapping = (table[0].long()[n_hist // bs] * bs + n_hist % bs).reshape(1)
        live = [a for a in arenas if a is not None]
        if live:
            paged.retain_step(live, table, [seq], [1])
        memo: dict = {}
        for i in range(L):
            q = torch.randn(1, Hq * D).to(dtype)
            k = torch.randn(1, Hkv * D).to(dtype)
            v = torch.randn(1, Hkv * D).to(dtype)
            output = torch.empty(1, Hq * D, dtype=dtype)
            rk, rv = plan.layers[i].rot_k, plan.layers[i].rot_v
            t0 = time.perf_counter()
            # do_kv_cache_update
            rotated: dict = {}
            if WRITE_MEMO:  # what the backend does (since issue 21 s8): built by the first layer of the step
                if "pos" not in memo:
                    memo["pos"] = paged.token_positions(qsl, seq_lens, 1)
                positions, row_lens = memo["pos"]
                paged.write(caches[i], fmts[i], k.view(1, Hkv, D), v.view(1, Hkv, D), slot_mapping, rk, rv,
                            positions=positions, row_seq_lens=row_lens, arena=arenas[i], rotated=rotated, memo=memo)
            else:  # the backend before: per layer
                positions, row_lens = paged.token_positions(qsl, seq_lens, 1)
                paged.write(caches[i], fmts[i], k.view(1, Hkv, D), v.view(1, Hkv, D), slot_mapping, rk, rv,
                            positions=positions, row_seq_lens=row_lens, arena=arenas[i], rotated=rotated)
            t1 = time.perf_counter()
            # forward
            rot = rotated if rotated.get("n") == 1 else {}
            out = paged.attend(q.view(1, Hq, D), caches[i], fmts[i], block_table=table, seq_lens=seq_lens,
                               query_start_loc=qsl, scale=scale, rot_k=rk, rot_v=rv, arena=arenas[i],
                               new_k=k.view(1, Hkv, D), new_v=v.view(1, Hkv, D), kernel=kernel, memo=memo,
                               evict=False, new_kr=rot.get("k"), new_vr=rot.get("v"))
            t2 = time.perf_counter()
            output[:1] = out.reshape(output[:1].shape).to(output.dtype)
            t3 = time.perf_counter()
            if record:
                t_w.append(t1 - t0)
                t_a.append(t2 - t1)
                t_l.append(t3 - t0)

    n = n0
    for _ in range(3):  # warm-up (kernel load, first allocations)
        step(n, False)
        n += 1
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(n, False)
        n += 1
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
        print(f"aten calls per layer-step: {ops / L:.0f}")
    for _ in range(args.steps):
        step(n, True)
        n += 1

    def ms(xs, p):
        xs = sorted(xs)
        return round(1e3 * xs[min(len(xs) - 1, int(p * len(xs)))], 4)

    res = {"tree": str(Path(paged.__file__).parents[2]), "fast_encode": not args.no_fast_encode, "context": n0, "layers": L, "steps": args.steps, "kernel": kernel, "threads": args.threads,
           "scheme": sch.describe(), "block_size": bs,
           "write_ms": {"p50": ms(t_w, 0.5), "p10": ms(t_w, 0.1)},
           "attend_ms": {"p50": ms(t_a, 0.5), "p10": ms(t_a, 0.1)},
           "layer_step_ms": {"p50": ms(t_l, 0.5), "p10": ms(t_l, 0.1), "mean": round(1e3 * statistics.fmean(t_l), 4)}}
    print(json.dumps(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
