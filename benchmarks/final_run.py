"""One device call for round 6 and the final tables: launch-shape sweep with the wave-aware split count,
pick the library defaults per regime from it, then -- with exactly those defaults -- Nsight Compute
stall reasons, `lowbit audit kernels`, `lowbit bench decode-attention` (the CLIs' own run functions,
in this process) and the real-cache end to end.

    PYTHONPATH=src python3 benchmarks/final_run.py --out $OUT

The chosen defaults are written to $OUT/final.json ("defaults"); the committed DEFAULTS in
lowbit/kernels/decode_attention.py must equal them (they are copied there after the run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types

os.environ.setdefault("TRITON_INTERPRET", "0")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import torch

T0 = time.time()
RES: dict = {}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep-until", type=float, default=150)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "final.json")

    def save():
        with open(path, "w") as f:
            json.dump(RES, f, indent=1, default=str)

    import round5_run
    from triton.testing import do_bench

    import lowbit.kernels.decode_attention as da
    from lowbit.kernels import bench

    RES["env"] = bench.env_info()
    log("env", RES["env"])
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    RES["copy_tbs"] = 2 * x.nbytes / do_bench(lambda: y.copy_(x), warmup=10, rep=50, return_mode="median") / 1e9
    x = y = None  # free the 4 GB
    log(f"d2d copy {RES['copy_tbs']:.2f} TB/s")

    # ---- sweep ----
    RES["sdpa"], RES["sweep"] = {}, []
    sweep = round5_run.SWEEP6
    for geo, B, L in dict.fromkeys((s[1], s[2], s[3]) for s in sweep):
        Hq, Hkv, D, group = bench.GEOMETRIES[geo]
        fns, keep = bench.sdpa_case(B, Hq, Hkv, D, L, bench.n_buffers(bench.dense_bytes(B, Hkv, L, D), 40e9))
        RES["sdpa"][f"{geo} B{B} L{L}"] = bench.graph_time_ms(fns)
        del fns, keep
        torch.cuda.empty_cache()
        log(f"sdpa {geo} B{B} L{L}: {RES['sdpa'][f'{geo} B{B} L{L}']:.4f} ms")
    for label, geo, B, L, kb, fields in sweep:
        if time.time() - T0 > a.sweep_until:
            log("sweep: time up")
            break
        Hq, Hkv, D, group = bench.GEOMETRIES[geo]
        pb = bench.packed_bytes(B, Hkv, L, D, kb, group)
        try:
            fns, keep = bench.kernel_case(B, Hq, Hkv, D, L, kb, kb, group, bench.n_buffers(pb, 40e9),
                                          da.KernelConfig(**fields))
            t = bench.graph_time_ms(fns)
            del fns, keep
        except Exception as e:  # noqa: BLE001
            log(f"{label} {geo} B{B} L{L} k{kb}: {e!r}"[:300])
            continue
        sd = RES["sdpa"][f"{geo} B{B} L{L}"]
        RES["sweep"].append({"label": label, "geometry": geo, "B": B, "L": L, "bits": kb, "fields": fields, "ms": t,
                             "x_sdpa": sd / t, "tbs": pb / t / 1e9, "num_splits": da.LAST_LAUNCH.get("num_splits")})
        log(f"{label:10s} {geo} B{B:2d} L{L:6d} k{kb}: {t:.4f} ms {sd / t:.2f}x {pb / t / 1e9:.2f} TB/s "
            f"splits {da.LAST_LAUNCH.get('num_splits')}")
        save()
    torch.cuda.empty_cache()

    # ---- choose the defaults: per regime, the launch shape with the lowest mean time relative to the
    # default over int2 and int4 (the shape's fields are laid over the regime's current default) ----
    chosen = {k: dict(v) for k, v in da.DEFAULTS.items()}
    for regime, (B, L) in (("many", (16, 32768)), ("few", (1, 131072))):
        rows = [r for r in RES["sweep"] if r["geometry"] == "llama3-8b" and r["B"] == B and r["L"] == L]
        first: dict = {}
        for r in rows:  # first time of each (shape, bits); "default" is timed again at the end for spread
            first.setdefault((r["label"], r["bits"]), r["ms"])
        base = {b: ms for (lab, b), ms in first.items() if lab == "default"}
        score: dict = {}
        for (lab, b), ms in first.items():
            if b in base:
                score.setdefault(lab, []).append(ms / base[b])
        score = {k: sum(v) / len(v) for k, v in score.items() if len(v) == len(base)}
        if score:
            best = min(score, key=score.get)
            fields = next(r["fields"] for r in rows if r["label"] == best)
            chosen[regime].update({k: v for k, v in fields.items() if k in chosen[regime]})
            log(f"{regime}: {best} ({score[best]:.3f} of default) -> {chosen[regime]}")
        RES.setdefault("scores", {})[regime] = score
    RES["defaults"] = chosen
    da.DEFAULTS.clear()
    da.DEFAULTS.update(chosen)
    save()

    # ---- ncu stall reasons with the chosen defaults ----
    ncu = round5_run.ncu_bin()
    if ncu:
        for tag, (B, L, regime) in (("b16_l32k_k2", (16, 32768, "many")), ("b1_l128k_k2", (1, 131072, "few"))):
            f = {k: v for k, v in chosen[regime].items() if v is not None}
            cmd = [ncu, "--clock-control", "none", "-k", "regex:_stage1", "--launch-skip", "3", "--launch-count", "1",
                   "--section", "SpeedOfLight", "--section", "SchedulerStats", "--section", "Occupancy",
                   "--metrics", r"smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
                   sys.executable, os.path.join(HERE, "ncu_case.py"), str(B), str(L), "2", json.dumps(f)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            with open(os.path.join(a.out, f"ncu_{tag}.txt"), "w") as fh:
                fh.write(p.stdout + "\n--- stderr ---\n" + p.stderr)
            log(f"ncu {tag}: rc {p.returncode}")

    # ---- audit + bench through the CLIs' run functions, with the chosen defaults ----
    from lowbit.commands import audit as audit_cmd
    from lowbit.commands import bench as bench_cmd

    rc = audit_cmd.run(types.SimpleNamespace(what="kernels", device="cuda", json=os.path.join(a.out, "audit.json")))
    RES["audit_rc"] = rc
    log(f"audit rc {rc}")
    save()
    torch.cuda.empty_cache()
    rc = bench_cmd.run(types.SimpleNamespace(what="decode-attention", batch="1,16,64", length="4k,32k,128k",
                                             geometry="llama3-8b,gemma3-1b", bits="2,4,8", mem_cap_gb=60.0,
                                             out=os.path.join(a.out, "bench.json")))
    RES["bench_rc"] = rc
    save()
    torch.cuda.empty_cache()

    # ---- end to end through the real caches (same process: same defaults) ----
    import e2e_model

    sys.argv = ["e2e_model.py", "--out", a.out, "--batches", "1,16"]
    try:
        e2e_model.main()
    except Exception as e:  # noqa: BLE001
        log(f"e2e failed: {e!r}")
    log("done")


if __name__ == "__main__":
    main()
