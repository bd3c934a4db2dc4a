"""One device call: sanity, audit vs twin at full shapes, config search, benchmark table, end to end.

    PYTHONPATH=src python3 benchmarks/device_run.py --out $OUT --stages sanity,audit,search,bench,e2e

Writes $OUT/results.json (everything, rewritten after each step) and prints a short table last.
Stops starting new work past --deadline seconds so the call ends inside its limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

T0 = time.time()
RES: dict = {"stages": {}}
OUT = "."
SUMMARY: list[str] = []


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def save():
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def left(deadline):
    return deadline - (time.time() - T0)


def stage_sanity():
    from lowbit.kernels import bench
    from lowbit.kernels.audit import audit

    RES["env"] = bench.env_info()
    log("env", RES["env"])
    try:
        RES["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu,memory.used",
             "--format=csv"], capture_output=True, text=True, timeout=20, check=False).stdout
    except Exception as e:  # noqa: BLE001
        RES["nvidia_smi"] = repr(e)
    rows = audit("cuda", cases=[("sanity B2 Hq8/Hkv2 D128 T1000 k2v2 +tiers",
                                 {"B": 2, "Hq": 8, "Hkv": 2, "D": 128, "T": 1000, "kbits": 2, "vbits": 2, "sink": 64, "recent": 256})])
    RES["stages"]["sanity"] = [r.as_dict() for r in rows]
    log("sanity", rows[0])
    # the device-to-device copy ceiling, bytes read + written
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    from triton.testing import do_bench

    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=50, return_mode="median")
    RES["copy_tbs"] = 2 * x.nbytes / ms / 1e9
    log(f"d2d copy {RES['copy_tbs']:.2f} TB/s")
    x = y = None  # free the 4 GB


def stage_audit(deadline, cfg=None):
    from lowbit.kernels.audit import audit, format_table, sweep

    rows = []
    for name, kw in sweep("cuda"):
        if left(deadline) < 30:
            log("audit: deadline, skipping the rest")
            break
        rows += audit("cuda", cases=[(name, kw)], config=cfg)
        log(f"audit {name}: rel {rows[-1].rel_l2:.2e} {'ok' if rows[-1].ok else 'FAIL'}")
        RES["stages"]["audit"] = [r.as_dict() for r in rows]
        save()
        torch.cuda.empty_cache()
    SUMMARY.append(format_table(rows))


def _time_cfg(geo, B, L, kb, cfg, nbuf_cap=40e9):
    from lowbit.kernels import bench

    Hq, Hkv, D, group = bench.GEOMETRIES[geo]
    pb = bench.packed_bytes(B, Hkv, L, D, kb, group)
    fns, keep = bench.kernel_case(B, Hq, Hkv, D, L, kb, kb, group, bench.n_buffers(pb, nbuf_cap), cfg)
    t = bench.graph_time_ms(fns)
    del fns, keep
    return t, pb


def _audit_stress(cfg):
    """Worst cases for the PV rounding (long contexts, iid values): max rel L2 error."""
    from lowbit.kernels.audit import audit

    cases = [("B1 Hq32/Hkv8 D128 T131072 k2v2", {"B": 1, "Hq": 32, "Hkv": 8, "D": 128, "T": 131072, "kbits": 2, "vbits": 2}),
             ("B16 Hq32/Hkv8 D128 T32768 k2v2", {"B": 16, "Hq": 32, "Hkv": 8, "D": 128, "T": 32768, "kbits": 2, "vbits": 2}),
             ("B4 Hq32/Hkv8 D128 T32768 k4v4", {"B": 4, "Hq": 32, "Hkv": 8, "D": 128, "T": 32768, "kbits": 4, "vbits": 4})]
    rows = audit("cuda", cases=cases, config=cfg)
    return max(r.rel_l2 for r in rows), [r.as_dict() for r in rows]


def stage_search(deadline, shapes, bits_list, grid, variants):
    """Precision variants (audited on the stress cases), then block/warps/stages, then splits."""
    from lowbit.kernels import bench
    from lowbit.kernels.decode_attention import KernelConfig, pick_num_splits

    out, var_res = [], []
    for var in variants:
        cfg = KernelConfig(**var)
        err, rows = _audit_stress(cfg)
        var_res.append({"variant": var, "max_rel_l2": err, "rows": rows})
        log(f"variant {var}: stress max rel L2 {err:.2e}")
    RES["stages"]["variants"] = var_res
    save()
    ok = [v for v in var_res if v["max_rel_l2"] <= 8e-4] or sorted(var_res, key=lambda v: v["max_rel_l2"])[:1]
    best = {}
    for geo, B, L in shapes:
        for kb in bits_list:
            res = []
            for v in ok:
                for (btw, nw, st) in grid:
                    if left(deadline) < 60:
                        break
                    cfg = KernelConfig(warp_tokens=btw, num_warps=nw, num_stages=st, **v["variant"])
                    try:
                        t, pb = _time_cfg(geo, B, L, kb, cfg)
                    except Exception as e:  # noqa: BLE001
                        log(f"search {geo} B{B} L{L} k{kb} {cfg}: {e!r}"[:300])
                        continue
                    res.append((t, cfg))
                    out.append({"geometry": geo, "B": B, "L": L, "bits": kb, "config": cfg.__dict__, "ms": t, "tbs": pb / t / 1e9})
                    log(f"search {geo} B{B} L{L} k{kb} {v['variant']} btw{btw} nw{nw} st{st}: {t:.4f} ms "
                        f"{pb / t / 1e9:.2f} TB/s")
            if not res:
                continue
            res.sort(key=lambda r: r[0])
            t0, c0 = res[0]
            Hkv = bench.GEOMETRIES[geo][1]
            auto = pick_num_splits(B, Hkv, L, c0.block_t, 132, c0.num_warps)
            for f in (0.25, 0.5, 2):
                ns = max(1, int(auto * f))
                if ns == auto or left(deadline) < 60:
                    continue
                cfg = KernelConfig(**{**c0.__dict__, "num_splits": ns})
                t, pb = _time_cfg(geo, B, L, kb, cfg)
                out.append({"geometry": geo, "B": B, "L": L, "bits": kb, "config": cfg.__dict__, "ms": t, "tbs": pb / t / 1e9})
                log(f"search {geo} B{B} L{L} k{kb} best-cfg splits {ns} (auto {auto}): {t:.4f} ms")
                if t < t0:
                    t0, c0 = t, cfg
            best[(geo, B, L, kb)] = c0
            RES["stages"]["search"] = out
            RES["best"] = {f"{k[0]} B{k[1]} L{k[2]} k{k[3]}": v.__dict__ for k, v in best.items()}
            save()
    return best


def stage_search_simple(deadline, shapes, grid, prec):
    from lowbit.kernels.decode_attention import KernelConfig

    best = {}
    out = RES["stages"].setdefault("search", [])
    for geo, B, L, kb in shapes:
        res = []
        for btw, nw, st in grid:
            if left(deadline) < 60:
                break
            cfg = KernelConfig(warp_tokens=btw, num_warps=nw, num_stages=st, **prec)
            try:
                t, pb = _time_cfg(geo, B, L, kb, cfg)
            except Exception as e:  # noqa: BLE001
                log(f"search {geo} B{B} L{L} k{kb} {cfg}: {e!r}"[:300])
                continue
            res.append((t, cfg))
            out.append({"geometry": geo, "B": B, "L": L, "bits": kb, "config": cfg.__dict__, "ms": t, "tbs": pb / t / 1e9})
            log(f"search {geo} B{B} L{L} k{kb} btw{btw} nw{nw} st{st}: {t:.4f} ms {pb / t / 1e9:.2f} TB/s")
        if res:
            best[(geo, B, L, kb)] = min(res, key=lambda r: r[0])[1]
    RES["best"].update({f"{k[0]} B{k[1]} L{k[2]} k{k[3]}": v.__dict__ for k, v in best.items()})
    save()
    return best


def stage_final_search(deadline):
    """Candidates per regime around the defaults; the winner of each regime becomes the default for
    the rest of this run (and is copied into decode_attention.DEFAULTS afterwards)."""
    import lowbit.kernels.decode_attention as da
    from lowbit.kernels.decode_attention import KernelConfig

    cands = {
        "many": [("llama3-8b", 16, 32768, (2, 4)),
                 [{"num_warps": 4, "warp_tokens": 32, "num_stages": 4, "maxnreg": None},
                  {"num_warps": 4, "warp_tokens": 32, "num_stages": 4, "maxnreg": 128},
                  {"num_warps": 4, "warp_tokens": 32, "num_stages": 3, "maxnreg": 128},
                  {"num_warps": 2, "warp_tokens": 32, "num_stages": 4, "maxnreg": None},
                  {"num_warps": 2, "warp_tokens": 32, "num_stages": 4, "maxnreg": 128}]],
        "few": [("llama3-8b", 1, 131072, (2, 4)),
                [{"num_warps": 1, "warp_tokens": 64, "num_stages": 3, "maxnreg": None},
                 {"num_warps": 1, "warp_tokens": 64, "num_stages": 3, "maxnreg": 128},
                 {"num_warps": 1, "warp_tokens": 32, "num_stages": 3, "maxnreg": None},
                 {"num_warps": 2, "warp_tokens": 64, "num_stages": 3, "maxnreg": None}]],
        "wide": [("gemma3-1b", 1, 131072, (2,)),
                 [{"num_warps": 1, "warp_tokens": 32, "num_stages": 3, "maxnreg": None},
                  {"num_warps": 2, "warp_tokens": 32, "num_stages": 3, "maxnreg": None},
                  {"num_warps": 4, "warp_tokens": 32, "num_stages": 3, "maxnreg": None}]],
    }
    out = RES["stages"].setdefault("final_search", [])
    for regime, ((geo, B, L, bitss), cl) in cands.items():
        scores = []
        for c in cl:
            if left(deadline) < 30:
                break
            tot = 0.0
            for kb in bitss:
                cfg = KernelConfig(**c)
                t, pb = _time_cfg(geo, B, L, kb, cfg)
                out.append({"regime": regime, "geometry": geo, "B": B, "L": L, "bits": kb, "config": c, "ms": t, "tbs": pb / t / 1e9})
                log(f"final-search {regime} {geo} B{B} L{L} k{kb} {c}: {t:.4f} ms {pb / t / 1e9:.2f} TB/s")
                tot += t
            scores.append((tot, c))
        if scores:
            da.DEFAULTS[regime] = dict(min(scores, key=lambda x: x[0])[1])
    RES["defaults"] = {k: dict(v) for k, v in da.DEFAULTS.items()}
    log("defaults now", RES["defaults"])
    save()


def stage_cache_smoke():
    """The real cache (lowbit.kv) calling the kernel: tiny random smollm2, int2, triton vs torch decode."""
    from lowbit.kv import QuantizedKVCache
    from lowbit.models.tiny import tiny_model

    model, cfg = tiny_model("smollm2-135m", num_layers=2, dtype=torch.bfloat16)
    model = model.to("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 900), device="cuda", generator=g)
    steps = torch.randint(0, cfg.vocab_size, (2, 6), device="cuda", generator=g)
    outs = {}
    for backend in ("torch", "triton"):
        cache = QuantizedKVCache(model, "int2", decode_backend=backend)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            lg = []
            for i in range(steps.shape[1]):
                o = model(input_ids=steps[:, i:i + 1], past_key_values=cache, use_cache=True)
                lg.append(o.logits[:, -1].float())
        outs[backend] = (torch.stack(lg), dict(cache.backend_calls), list(cache.backend_notes))
    a, b = outs["triton"][0], outs["torch"][0]
    rel = float((a - b).norm() / b.norm())
    RES["stages"]["cache_smoke"] = {"rel_logits": rel, "triton_calls": outs["triton"][1], "torch_calls": outs["torch"][1],
                                        "notes": outs["triton"][2]}
    log(f"cache smoke: logits rel diff triton vs torch {rel:.2e}; calls {outs['triton'][1]}; notes {outs['triton'][2]}")
    save()


def stage_bench(deadline, best, batches, lengths, geos, bits):
    from lowbit.kernels import bench
    from lowbit.kernels.decode_attention import KernelConfig

    def cfg_for(geo, B, L, kb):
        if (geo, B, L, kb) in best:
            return best[(geo, B, L, kb)]
        # nearest searched shape of this geometry (by B, then L), its config with auto splits
        cands = [(abs(k[1] - B), abs(k[2] - L), k) for k in best if k[0] == geo and k[3] == kb]
        cands = cands or [(abs(k[1] - B), abs(k[2] - L), k) for k in best if k[0] == geo]
        if not cands:
            return KernelConfig()  # the library's per-shape defaults
        c = best[min(cands)[2]]
        return KernelConfig(**{**c.__dict__, "num_splits": None})

    rows = []
    for geo in geos:
        for B in batches:
            for L in lengths:
                if left(deadline) < 45:
                    log("bench: deadline")
                    break
                cfgs = {(geo, B, L, kb): cfg_for(geo, B, L, kb) for kb, _ in bits}
                try:
                    r = bench.run((B,), (L,), (geo,), bits, configs=cfgs, mem_cap_gb=60.0,
                                  event_timing=(B, L) in ((16, 32768), (1, 131072)), log=log)
                except Exception as e:  # noqa: BLE001
                    log(f"bench {geo} B{B} L{L}: {e!r}"[:400])
                    traceback.print_exc()
                    continue
                rows += r["rows"]
                RES["stages"]["bench"] = rows
                save()
                torch.cuda.empty_cache()
    SUMMARY.append("\n".join(bench.format_row(r, bits) for r in rows))
    return rows


def stage_e2e(deadline, cases, cfg=None):
    import e2e_decode

    out = {"capacity_100GB": e2e_decode.capacity()}
    RES["stages"]["e2e"] = out
    for B, L in cases:
        for mode in ("bf16", "int2"):
            if left(deadline) < 60:
                log("e2e: deadline")
                break
            try:
                m = e2e_decode.SyntheticLlama(B, L, mode)
                if cfg is not None:
                    m.cfg = cfg  # else the library defaults
                t = m.time_ms()
                out[f"B{B} L{L} {mode}"] = {"step_ms": t, "tokens_per_s": B / t * 1e3, "kv_bytes": m.kv_bytes,
                                                "kv_bytes_per_token": m.kv_bytes_per_token}
                log(f"e2e B{B} L{L} {mode}: {t:.3f} ms/step, {B / t * 1e3:.1f} tok/s, KV {m.kv_bytes / 1e9:.1f} GB")
                del m
            except Exception as e:  # noqa: BLE001
                log(f"e2e B{B} L{L} {mode}: {e!r}"[:400])
            torch.cuda.empty_cache()
            save()
    SUMMARY.append(json.dumps({k: v for k, v in out.items() if k != "capacity_100GB"}, indent=0))


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--stages", default="sanity,search,audit,bench,e2e,pytest")
    ap.add_argument("--deadline", type=float, default=540)
    ap.add_argument("--bench-batches", default="1,16,64")
    ap.add_argument("--bench-lengths", default="4096,32768,131072")
    ap.add_argument("--bench-geos", default="llama3-8b,gemma3-1b")
    a = ap.parse_args()
    OUT = a.out
    os.makedirs(OUT, exist_ok=True)
    stages = a.stages.split(",")
    try:
        if "sanity" in stages:
            stage_sanity()
            save()
        if "audit" in stages:
            stage_audit(a.deadline - 200)
        if "final_search" in stages:
            stage_final_search(a.deadline - 360)
        if "audit" in stages:
            stage_audit(a.deadline - 290)
        if "bench" in stages:
            ints = lambda s: tuple(int(x) for x in s.split(","))
            stage_bench(a.deadline - 170, {}, ints(a.bench_batches), ints(a.bench_lengths),
                        tuple(a.bench_geos.split(",")), ((2, 2), (4, 4), (8, 8)))
        if "e2e" in stages:
            stage_e2e(a.deadline - 80, [(1, 32768), (16, 32768)])
        if "cache" in stages and left(a.deadline) > 60:
            try:
                stage_cache_smoke()
            except Exception as e:  # noqa: BLE001
                log(f"cache smoke failed: {e!r}"[:600])
                traceback.print_exc()
                RES["stages"]["cache_smoke"] = repr(e)
        if "pytest" in stages and left(a.deadline) > 40:
            env = dict(os.environ, TRITON_INTERPRET="0")
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/kernels"], env=env,
                               capture_output=True, text=True, timeout=max(10, left(a.deadline) - 10), check=False)
            RES["stages"]["pytest_gpu"] = r.stdout[-3000:]
            log("pytest -m gpu:", r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-500:])
    finally:
        save()
        print("\n".join(SUMMARY))
        log("done")


if __name__ == "__main__":
    main()
