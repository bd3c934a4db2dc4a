"""One device call for an optimisation round: time kernel variants side by side with bf16 SDPA in
the same process, then audit the candidates against the torch twin at full shapes.

    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/variants_run.py --out $OUT

Variants are KernelConfig fields over the library defaults (benchmarks/NOTES.md, round 4). Writes
$OUT/variants.json after every step and prints a short table last. Stops starting new work past
--deadline seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch

T0 = time.time()
RES: dict = {}
VARIANTS = {
    "base": {},
    "fresh": {"v_center": False, "pv_fresh": True},
    "fresh+szdirect": {"v_center": False, "pv_fresh": True, "sz_direct": True},
    "szdirect": {"sz_direct": True},
}
SHAPES = [("llama3-8b", 16, 32768, 2), ("llama3-8b", 16, 32768, 4), ("llama3-8b", 1, 131072, 2),
          ("llama3-8b", 1, 131072, 4)]


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--deadline", type=float, default=480)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "variants.json")

    def save():
        with open(path, "w") as f:
            json.dump(RES, f, indent=1, default=str)

    def left():
        return a.deadline - (time.time() - T0)

    from lowbit.kernels import bench
    from lowbit.kernels.audit import audit, sweep
    from lowbit.kernels.decode_attention import KernelConfig

    RES["env"] = bench.env_info()
    log("env", RES["env"])
    # copy ceiling (bytes read + written)
    from triton.testing import do_bench

    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    RES["copy_tbs"] = 2 * x.nbytes / do_bench(lambda: y.copy_(x), warmup=10, rep=50, return_mode="median") / 1e9
    x = y = None
    log(f"d2d copy {RES['copy_tbs']:.2f} TB/s")

    # quick correctness gate per variant before timing it (one mid-size case)
    RES["gate"] = {}
    for name, v in VARIANTS.items():
        r = audit("cuda", cases=[("gate B3 Hq32/Hkv8 D128 T5000 k2v2 ragged +tiers",
                                  {"B": 3, "Hq": 32, "Hkv": 8, "D": 128, "T": 5000, "kbits": 2, "vbits": 2,
                                   "ragged": True, "sink": 64, "recent": 256})], config=KernelConfig(**v))[0]
        RES["gate"][name] = r.as_dict()
        log(f"gate {name}: rel {r.rel_l2:.2e} {'ok' if r.ok else 'FAIL'}")
    save()

    # timing: SDPA once per shape, each variant, base again at the end (run-to-run spread)
    RES["sdpa"], RES["times"] = {}, []
    for geo, B, L in sorted({s[:3] for s in SHAPES}):
        Hq, Hkv, D, group = bench.GEOMETRIES[geo]
        db = bench.dense_bytes(B, Hkv, L, D)
        fns, keep = bench.sdpa_case(B, Hq, Hkv, D, L, bench.n_buffers(db, 40e9))
        RES["sdpa"][f"{geo} B{B} L{L}"] = t = bench.graph_time_ms(fns)
        del fns, keep
        torch.cuda.empty_cache()
        log(f"sdpa {geo} B{B} L{L}: {t:.4f} ms")
    order = list(VARIANTS) + ["base"]
    for rep, name in enumerate(order):
        for geo, B, L, kb in SHAPES:
            if left() < 200:
                log("timing: deadline")
                break
            Hq, Hkv, D, group = bench.GEOMETRIES[geo]
            pb = bench.packed_bytes(B, Hkv, L, D, kb, group)
            cfg = KernelConfig(**VARIANTS[name])
            try:
                fns, keep = bench.kernel_case(B, Hq, Hkv, D, L, kb, kb, group, bench.n_buffers(pb, 40e9), cfg)
                t = bench.graph_time_ms(fns)
                del fns, keep
            except Exception as e:  # noqa: BLE001
                log(f"time {name} {geo} B{B} L{L} k{kb}: {e!r}"[:400])
                continue
            sd = RES["sdpa"][f"{geo} B{B} L{L}"]
            RES["times"].append({"variant": name, "pass": 1 if rep == len(order) - 1 else 0, "geometry": geo, "B": B,
                                 "L": L, "bits": kb, "ms": t, "x_sdpa": sd / t, "tbs": pb / t / 1e9})
            log(f"time {name:16s} {geo} B{B:2d} L{L:6d} k{kb}: {t:.4f} ms  {sd / t:.2f}x  {pb / t / 1e9:.2f} TB/s")
            save()
    torch.cuda.empty_cache()

    # audit: the fastest non-base variant first, full sweep (stress cases included)
    best = {}
    for r in RES["times"]:
        if r["variant"] != "base" and r["B"] == 16 and r["bits"] == 2:
            best[r["variant"]] = r["ms"]
    cands = sorted(best, key=best.get)
    RES["audit"] = {}
    for name in cands:
        rows = []
        for case, kw in sweep("cuda"):
            if left() < 25:
                log("audit: deadline")
                break
            rows += audit("cuda", cases=[(case, kw)], config=KernelConfig(**VARIANTS[name]))
            log(f"audit {name} {case}: rel {rows[-1].rel_l2:.2e} {'ok' if rows[-1].ok else 'FAIL'}")
            RES["audit"][name] = [r.as_dict() for r in rows]
            save()
            torch.cuda.empty_cache()
    save()
    print("\n== summary ==")
    for r in RES["times"]:
        print(f"{r['variant']:16s} p{r['pass']} B{r['B']:2d} L{r['L']:6d} k{r['bits']}: {r['ms']:.4f} ms "
              f"{r['x_sdpa']:.2f}x {r['tbs']:.2f} TB/s")
    for name, rows in RES["audit"].items():
        print(f"audit {name}: {sum(r['ok'] for r in rows)}/{len(rows)} ok, max rel {max(r['rel_l2'] for r in rows):.2e}")
    log("done")


if __name__ == "__main__":
    main()
