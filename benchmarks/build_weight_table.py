"""Build lowbit/kernels/gemm/tables/sm<cap>.json (the dispatch table) from committed explorations.

    python3 benchmarks/build_weight_table.py OUT.json EXPLORE.json [EXPLORE.json ...] [AUDIT.json BENCH.json ...]

Each exploration row times candidates (launch configs, GEMV configs, dequantize + cuBLAS) against
cuBLAS bf16 at one (scheme, shape, M). Files are given oldest first; a later file's timing of the
same (scheme, shape, M, candidate) replaces an earlier one (kernels change between runs). Per kind
and M bucket the table takes the candidate with the best geometric-mean speed-up over bf16 across
the shapes timed at the bucket's representative M (or the next timed M above it), among candidates whose rel L2 against the twin
passed (< 1e-3; 1e-2 through dequantize + cuBLAS) and that were timed on every shape. Without a W4A8
exploration W4A8 takes W8A8's cells. An "a16-xq:PATH:CONFIG" candidate (A8 weights' activation codes through an
A16 path, lowbit.kernels.gemm.dispatch.linear_via_a16) is tabled as path a16-xq, config PATH:CONFIG.
Where the CUDA small-M kernel (path "cuda", M <= 64) wins a bucket, the best other candidate follows it
as a second cell for the same M: the dispatch falls through to it for a weight or input the CUDA kernel
does not take (or a machine without nvcc); behind a warp-split winner (cuda-ws-*, 4-bit, M <= 16) the best
x-staging CUDA candidate comes first.

Bench files (`lowbit bench gemm` JSON, "rows") time one candidate per cell, the table's kernel then, on shapes
no exploration covers (smollm2's 576-wide linears, the DiT shapes): a row counts where an audit file given
(`lowbit audit kernels --weights --json`, same shape names) passed that (scheme, shape, M, kernel), and only for a
(scheme, N, K) that no exploration timed. Such a shape gets a cell only where the bucket's pick was timed on it
too (a bench file of the current table), so two tables' bench runs decide between their two kernels.

Shape cells: for every weight shape timed at a bucket's representative M (the table's three, and any other an
exploration timed: k/v, the runtime's fused q|k|v and gate|up), a candidate that beats the bucket's pick on that
shape by more than SHAPE_GAIN gets a cell for that (N, K) ahead of the bucket's cells (a GEMV's best launch
geometry depends on how its row blocks fill the SMs, which one config per M bucket cannot follow).
"""

from __future__ import annotations

import json
import math
import sys

from lowbit.kernels.gemm.check import tolerance

# 17-32 / 33-64: the CUDA kernel's cost steps with its activation tiles (4 for M 17-32, 8 above), bf16's hardly
BUCKETS = [(1, 1, 1), (2, 4, 4), (5, 8, 8), (9, 16, 16), (17, 32, 32), (33, 64, 64), (65, 256, 256), (257, 1024, 1024),
           (1025, None, 4096)]
# 4-bit A16 splits 65-256 at 128: the tiled CUDA kernel's explorations time M 128, where the mma.sync tiles still compete
BUCKETS_W4A16 = BUCKETS[:6] + [(65, 128, 128), (129, 256, 256)] + BUCKETS[7:]
SHAPES = ("gate/up", "down", "qkv/o")  # the shapes every exploration timed
CUDA_M_MAX = 64  # lowbit.kernels.gemm.cuda_gemm.M_MAX
WS_M_MAX = 16  # lowbit.kernels.gemm.cuda_gemm.WARP_SPLIT_M_MAX
SHAPE_GAIN = 1.03
KIND = {"w4a16-g128": "w4a16", "w8a16": "w8a16", "w8a8": "w8a8", "w4a8-g128": "w4a8"}


def inner(name: str) -> str:
    """An a16-xq candidate's A16 kernel name ("a16-xq:cuda:cuda-rt2-w8-sk0" -> "cuda-rt2-w8-sk0"); others as they are."""
    return name.split(":")[-1] if name.startswith("a16-xq:") else name


def config_of(name: str) -> str | None:
    if name.startswith("a16-xq:"):
        return name[len("a16-xq:"):]
    return None if name == "dequant-cublas" else name


def path_of(name: str) -> str:
    if name.startswith("a16-xq:"):
        return "a16-xq"
    if name.startswith("cuda-"):
        return "cuda"
    return "dequant-cublas" if name == "dequant-cublas" else ("gemv" if name.startswith("gemv-") else "triton")


def gemv_bm(name: str) -> int:
    return int(name.split("-bm")[1].split("-")[0])


def bench_candidate(kernel: str) -> str:
    """A bench row's kernel ("cuda:CONFIG", "triton:CONFIG", "gemv:CONFIG", "dequant-cublas", "a16-xq:...") as an
    exploration names its candidate."""
    path, _, config = kernel.partition(":")
    return kernel if path in ("a16-xq", "dequant-cublas") else config


def fits(name: str, hi: int | None) -> bool:
    """Whether a candidate may hold a bucket whose largest M is hi (the GEMV and CUDA kernels' M limits)."""
    n = inner(name)
    if n.startswith("gemv-") and gemv_bm(n) < (hi or 10**9):
        return False
    if n.startswith("cuda-ws-") and (hi is None or hi > WS_M_MAX):
        return False
    if n.startswith("cuda-tl-"):  # the tiled kernel takes any M
        return True
    return not n.startswith("cuda-") or (hi is not None and hi <= CUDA_M_MAX)


def main(out: str, files: list[str]) -> None:
    cells: dict[tuple, dict] = {}  # (scheme, shape, M) -> {cand: ratio}
    nk: dict[tuple, tuple] = {}  # (scheme, shape) -> (N, K)
    gpu = None
    docs = [json.load(open(f)) for f in files]
    audited = {(r["scheme"], r["shape"], r["M"], r["kernel"]) for d in docs if "dispatch_after_audit" in d
               for r in d["rows"] if r.get("ok")}
    bench_shapes: set = set()  # (scheme, shape) known from bench rows only
    for d in docs:
        gpu = gpu or d.get("env", {}).get("gpu")
        for r in d.get("explore", []) + d.get("gemv", []):
            key = (r["scheme"], r["shape"], r["M"])
            nk[key[:2]] = (r["N"], r["K"])
            slot = cells.setdefault(key, {})
            rels = r.get("rel_l2", {})
            for name, ms in r["candidates"].items():
                ok_rel = name == "dequant-cublas" or (isinstance(rels.get(name), float) and rels[name] < tolerance(name))
                if isinstance(ms, float) and ok_rel:
                    slot[name] = r["bf16_ms"] / ms
                else:
                    slot.pop(name, None)
    explored = {(sch, n_k) for (sch, _), n_k in nk.items()}
    for d in docs:
        if "dispatch_after_audit" in d:
            continue
        for r in d.get("rows", []):
            key = (r["scheme"], r["shape"], r["M"])
            if (r["scheme"], (r["N"], r["K"])) in explored or (*key, r["kernel"]) not in audited:
                continue
            nk[key[:2]] = (r["N"], r["K"])
            bench_shapes.add(key[:2])
            cells.setdefault(key, {})[bench_candidate(r["kernel"])] = r["bf16_ms"] / r["ms"]
    table = []
    for scheme, kind in KIND.items():
        for lo, hi, rep in (BUCKETS_W4A16 if kind == "w4a16" else BUCKETS):
            # a bucket whose representative M was not timed for this scheme takes the next timed M above it
            timed = sorted({k[2] for k in cells if k[0] == scheme and k[2] >= max(rep, 16 if kind == "w8a8" else 1)})
            reps = timed[:1]
            rows = {k: v for k, v in cells.items() if k[0] == scheme and k[2] in reps and k[1] in SHAPES}
            if not rows:
                continue
            names = set.intersection(*(set(v) for v in rows.values()))
            names = {n for n in names if fits(n, hi)}
            if not names:
                continue
            score = {n: math.exp(sum(math.log(v[n]) for v in rows.values()) / len(rows)) for n in names}
            best = max(score, key=score.get)
            picks = [best]
            if inner(best).startswith("cuda-ws-"):  # 4-bit M <= 8 only: the x-staging kernel next
                rest = {n: v for n, v in score.items() if inner(n).startswith("cuda-") and not inner(n).startswith("cuda-ws-")}
                picks += [max(rest, key=rest.get)] if rest else []
            if inner(best).startswith("cuda-"):  # the next cell covering the bucket: where the CUDA kernel passes a weight over
                rest = {n: v for n, v in score.items() if not inner(n).startswith("cuda-")}
                picks += [max(rest, key=rest.get)] if rest else []
            # shape cells: every shape timed at the representative M whose own best beats the bucket's pick there
            for (sch, shape, m), slot in sorted(cells.items()):
                if sch != scheme or m not in reps:
                    continue
                own = {n: v for n, v in slot.items() if fits(n, hi)}
                if not own:
                    continue
                top = max(own, key=own.get)
                if (sch, shape) in bench_shapes and best not in own:
                    continue  # only the old table's kernel was timed here: no evidence it beats the pick
                if top != best and own[top] > SHAPE_GAIN * own.get(best, 0.0):
                    N, K = nk[(sch, shape)]
                    table.append({"kind": kind, "m_lo": lo, "m_hi": hi, "path": path_of(top), "config": config_of(top),
                                  "shape": [N, K], "speedup_vs_bf16": round(own[top], 3),
                                  "bucket_pick_speedup": round(own[best], 3) if best in own else None,
                                  "shapes": [shape]})
            for n in picks:
                table.append({"kind": kind, "m_lo": lo, "m_hi": hi, "path": path_of(n),
                              "config": config_of(n),
                              "geomean_speedup_vs_bf16": round(score[n], 3), "shapes": sorted(k[1] for k in rows)})
    if not any(c["kind"] == "w4a8" for c in table):  # no W4A8 exploration: W8A8's int8 cells
        table += [{**c, "kind": "w4a8"} for c in table if c["kind"] == "w8a8"]
    res = {"gpu": gpu, "capability": [9, 0], "built_from": files, "cells": table}
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)
    for c in table:
        print(f"{c['kind']:<6} M {c['m_lo']}-{c['m_hi'] or 'inf'}: {c['path']} {c['config'] or ''} "
              + (f"shape {c['shape']} x{c['speedup_vs_bf16']}" if "shape" in c else f"x{c['geomean_speedup_vs_bf16']}"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
