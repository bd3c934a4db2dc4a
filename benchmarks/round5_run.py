"""One device call for round 5: launch-config sweep (split counts, stages, warps) side by side with bf16
SDPA in the same process, Nsight Compute stall/issue sections of the shipped kernel, and the end to end
through the real caches (benchmarks/e2e_model.py).

    PYTHONPATH=src python3 benchmarks/round5_run.py --out $OUT [--skip ncu,e2e]

Writes $OUT/round5.json after each step; ncu text reports to $OUT/ncu_*.txt.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "0")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import torch

T0 = time.time()
RES: dict = {}

# (label, geometry, B, L, bits, KernelConfig fields)
SWEEP = [
    ("base", "llama3-8b", 16, 32768, 2, {}),
    ("splits3", "llama3-8b", 16, 32768, 2, {"num_splits": 3}),
    ("splits4", "llama3-8b", 16, 32768, 2, {"num_splits": 4}),
    ("stages5", "llama3-8b", 16, 32768, 2, {"num_stages": 5}),
    ("w2s4", "llama3-8b", 16, 32768, 2, {"num_warps": 2, "num_stages": 4}),
    ("w2s4x12", "llama3-8b", 16, 32768, 2, {"num_warps": 2, "num_stages": 4, "num_splits": 12}),
    ("base", "llama3-8b", 16, 32768, 4, {}),
    ("splits3", "llama3-8b", 16, 32768, 4, {"num_splits": 3}),
    ("stages5", "llama3-8b", 16, 32768, 4, {"num_stages": 5}),
    ("w2s4", "llama3-8b", 16, 32768, 4, {"num_warps": 2, "num_stages": 4}),
    ("base", "llama3-8b", 1, 131072, 2, {}),
    ("splits176", "llama3-8b", 1, 131072, 2, {"num_splits": 176}),
    ("splits264", "llama3-8b", 1, 131072, 2, {"num_splits": 264}),
    ("stages4", "llama3-8b", 1, 131072, 2, {"num_stages": 4}),
    ("s4x176", "llama3-8b", 1, 131072, 2, {"num_stages": 4, "num_splits": 176}),
    ("t32x264", "llama3-8b", 1, 131072, 2, {"warp_tokens": 32, "num_splits": 264}),
    ("w2t64x132", "llama3-8b", 1, 131072, 2, {"num_warps": 2, "num_splits": 132}),
    ("base", "llama3-8b", 1, 131072, 4, {}),
    ("splits176", "llama3-8b", 1, 131072, 4, {"num_splits": 176}),
    ("t32x264", "llama3-8b", 1, 131072, 4, {"warp_tokens": 32, "num_splits": 264}),
    ("base", "gemma3-1b", 1, 131072, 2, {}),
    ("splits128", "gemma3-1b", 1, 131072, 2, {"num_splits": 128}),
    ("splits256", "gemma3-1b", 1, 131072, 2, {"num_splits": 256}),
    ("base", "llama3-8b", 16, 32768, 2, {}),  # again: run-to-run spread
    ("base", "llama3-8b", 1, 131072, 2, {}),
]

# round 6: the wave-aware split count (auto) with each launch shape; splits are the kernel's own choice
SWEEP6 = []
for _bits in (2, 4):
    for _lab, _f in (("default", {}), ("w4s3", {"num_stages": 3}), ("w1t32s3", {"num_warps": 1, "num_stages": 3}),
                     ("w2t32s4", {"num_warps": 2}),
                     ("w1t64r168", {"num_warps": 1, "warp_tokens": 64, "num_stages": 3, "maxnreg": 168})):
        SWEEP6.append((_lab, "llama3-8b", 16, 32768, _bits, _f))
    for _lab, _f in (("default", {}), ("t32s3", {"warp_tokens": 32}), ("t32s4", {"warp_tokens": 32, "num_stages": 4}),
                     ("t64r168", {"maxnreg": 168})):
        SWEEP6.append((_lab, "llama3-8b", 1, 131072, _bits, _f))
SWEEP6 += [("default", "llama3-8b", 64, 32768, 2, {}), ("old2splits", "llama3-8b", 64, 32768, 2, {"num_splits": 2}),
           ("default", "llama3-8b", 16, 32768, 2, {}), ("default", "llama3-8b", 1, 131072, 2, {})]


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def ncu_bin():
    for c in [shutil.which("ncu")] + sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")) + [
            "/usr/local/cuda/bin/ncu"]:
        if c and os.path.exists(c):
            return c
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip", default="")
    ap.add_argument("--round", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=540)
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"round{a.round}.json")

    def save():
        with open(path, "w") as f:
            json.dump(RES, f, indent=1, default=str)

    from triton.testing import do_bench

    from lowbit.kernels import bench
    from lowbit.kernels.decode_attention import KernelConfig

    RES["env"] = bench.env_info()
    log("env", RES["env"])
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    RES["copy_tbs"] = 2 * x.nbytes / do_bench(lambda: y.copy_(x), warmup=10, rep=50, return_mode="median") / 1e9
    x = y = None  # free the 4 GB
    log(f"d2d copy {RES['copy_tbs']:.2f} TB/s")

    RES["sdpa"], RES["sweep"] = {}, []
    sweep = SWEEP6 if a.round == 6 else SWEEP
    if "sweep" not in skip:
        from lowbit.kernels.decode_attention import LAST_LAUNCH

        for geo, B, L in dict.fromkeys((s[1], s[2], s[3]) for s in sweep):
            Hq, Hkv, D, group = bench.GEOMETRIES[geo]
            fns, keep = bench.sdpa_case(B, Hq, Hkv, D, L, bench.n_buffers(bench.dense_bytes(B, Hkv, L, D), 40e9))
            RES["sdpa"][f"{geo} B{B} L{L}"] = t = bench.graph_time_ms(fns)
            del fns, keep
            torch.cuda.empty_cache()
            log(f"sdpa {geo} B{B} L{L}: {t:.4f} ms")
        for label, geo, B, L, kb, fields in sweep:
            if time.time() - T0 > 0.6 * a.deadline:
                log("sweep: deadline")
                break
            Hq, Hkv, D, group = bench.GEOMETRIES[geo]
            pb = bench.packed_bytes(B, Hkv, L, D, kb, group)
            try:
                fns, keep = bench.kernel_case(B, Hq, Hkv, D, L, kb, kb, group, bench.n_buffers(pb, 40e9),
                                              KernelConfig(**fields))
                t = bench.graph_time_ms(fns)
                del fns, keep
            except Exception as e:  # noqa: BLE001
                log(f"{label} {geo} B{B} L{L} k{kb}: {e!r}"[:300])
                continue
            sd = RES["sdpa"][f"{geo} B{B} L{L}"]
            RES["sweep"].append({"label": label, "geometry": geo, "B": B, "L": L, "bits": kb, "fields": fields,
                                 "ms": t, "x_sdpa": sd / t, "tbs": pb / t / 1e9,
                                 "num_splits": LAST_LAUNCH.get("num_splits")})
            log(f"{label:10s} {geo} B{B:2d} L{L:6d} k{kb}: {t:.4f} ms {sd / t:.2f}x {pb / t / 1e9:.2f} TB/s "
                f"splits {LAST_LAUNCH.get('num_splits')}")
            save()
        torch.cuda.empty_cache()

    if "ncu" not in skip:
        ncu = ncu_bin()
        RES["ncu"] = {"bin": ncu}
        log("ncu", ncu)
        if ncu:
            for tag, args in (("b16_l32k_k2", ["16", "32768", "2"]), ("b1_l128k_k2", ["1", "131072", "2"])):
                if time.time() - T0 > 0.65 * a.deadline:
                    break
                cmd = [ncu, "--clock-control", "none", "-k", "regex:_stage1", "--launch-skip", "3", "--launch-count",
                       "1", "--section", "SpeedOfLight", "--section", "SchedulerStats", "--section", "WarpStateStats",
                       "--section", "Occupancy", "--section", "LaunchStats", "--section", "ComputeWorkloadAnalysis",
                       "--section", "MemoryWorkloadAnalysis", "--metrics",
                       ("smsp__inst_executed.sum,smsp__cycles_active.avg,sm__cycles_elapsed.avg,"
                        "smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum"),
                       sys.executable, os.path.join(HERE, "ncu_case.py"), *args]
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=False)
                with open(os.path.join(a.out, f"ncu_{tag}.txt"), "w") as f:
                    f.write(p.stdout + "\n--- stderr ---\n" + p.stderr)
                RES["ncu"][tag] = p.returncode
                # stall reasons: warp cycles stalled per issued instruction, by reason
                p2 = subprocess.run([ncu, "--clock-control", "none", "-k", "regex:_stage1", "--launch-skip", "3",
                                     "--launch-count", "1", "--metrics",
                                     r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
                                     sys.executable, os.path.join(HERE, "ncu_case.py"), *args],
                                    capture_output=True, text=True, timeout=150, check=False)
                with open(os.path.join(a.out, f"ncu_{tag}_stalls.txt"), "w") as f:
                    f.write(p2.stdout + "\n--- stderr ---\n" + p2.stderr)
                print(p2.stdout[-3000:])
                log(f"ncu {tag}: rc {p.returncode}")
                print(p.stdout[-6000:])
        save()

    if "e2e" not in skip:
        left = a.deadline - (time.time() - T0)
        log(f"e2e with {left:.0f}s left")
        p = subprocess.run([sys.executable, os.path.join(HERE, "e2e_model.py"), "--out", a.out, "--batches", "1,16"],
                           text=True, timeout=max(60, left - 10), check=False)
        RES["e2e_rc"] = p.returncode
        save()
    print("\n== summary ==")
    print(f"copy {RES['copy_tbs']:.2f} TB/s; sdpa", {k: round(v, 4) for k, v in RES["sdpa"].items()})
    for r in RES["sweep"]:
        print(f"{r['label']:10s} {r['geometry']} B{r['B']:2d} L{r['L']:6d} k{r['bits']}: {r['ms']:.4f} ms "
              f"{r['x_sdpa']:.2f}x {r['tbs']:.2f} TB/s splits {r.get('num_splits')}")
    log("done")


if __name__ == "__main__":
    main()
