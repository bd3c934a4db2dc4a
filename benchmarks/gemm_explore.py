"""Exploration for the weight-GEMM dispatch table (one device call): wide launch-config sweeps of
lowbit's kernel per M bucket, and gemlite (a Triton low-bit GEMM library, carried as a wheel) side by
side, all timed with kernels.bench.graph_time_ms against cuBLAS bf16 in the same process.

    python3 benchmarks/gemm_explore.py OUT.json [--no-gemlite | --no-explore | --gemv | --final | --cuda | --cuda-ws | --cuda-ws16 | --cuda-pdl | --cuda-quick | --cuda-lb | --cuda-tiled | --a8 | --a8-split | --a8-retime | --a8-tma
                                          | --swap]

--cuda: the CUDA C++ small-M kernel (lowbit.kernels.gemm.cuda_gemm, M 1..16) in several launch geometries beside
the Triton cell the committed table runs there, for w4a16-g128, w8a16 and w4a16-g64-asym on the 8B shapes.

--cuda-ws: the warp-split CUDA kernel (4-bit, M <= 16; CudaConfig.NB > 0) in its instances beside the x-staging
kernel, W4A16 g128 and g64-asym at M 1/2/4/8/16, with cuBLAS bf16 on N/4 rows (the packed weight's bytes) at M=1.
--cuda-ws16: the same at M = 16 alone (the two-activation-tile instances), every launch with PDL. --cuda-lb: the
warp-split instances under launch bound 256 (up to 255 registers) beside the default 512 (128 registers), M 1 / 4 / 16.

--cuda-tiled: the tiled 4-bit kernel (lowbit.kernels.gemm.tiled) at M 17-4096 beside the tabled cell and dequantize +
cuBLAS, W4A16 g128 and g64-asym on the 8B and fused shapes. --cuda-wgmma: the same sweep over its wgmma instances. (A --cuda-tiled-l2 run timed the first version's L2 prefetch
sizes and splits: no change; the flag was removed after. Its file is in git history:
benchmarks/results/weights/gemm_explore_tiled_l2_s23_NVIDIA_H200.json.)

--cuda-pdl: W4A16 g128 through the CUDA kernels' best launches with and without programmatic dependent launch.

--a8: A8 weights (w8a8, w4a8-g128) at the table's representative M: the tabled int8 cell beside "a16-xq" (the
activation codes through every A16 cell the table has there for the same weight bits). --a8-split: W8A8's int8 kernel at M 16-256 with split-K. --a8-retime: W8A8 re-timed at every
table M after its weight tile went straight into the dot, with larger tiles at M >= 256. --a8-tma: W8A8
through TMA descriptors (GemmConfig.tma) beside the table's tiles.

--swap: A16 with the operands swapped (the weight tile as the dot's first operand) at M 4-1024. (A --swap-split run,
W4A16 swapped with the split unpack, measured 0.06-0.62x (git history: benchmarks/results/weights/gemm_explore_swap_split_NVIDIA_H200.json); that
variant was deleted.)

benchmarks/build_weight_table.py turns these JSONs into the dispatch table lowbit/kernels/gemm/tables/sm90.json.
The explorations sm90.json was built from are no longer tracked (results/ keeps only what a current claim cites):
`git show 9c6f28e^:benchmarks/results/weights/gemm_explore_<name>_NVIDIA_H200.json` gives each back; re-running
this script writes new ones (under ./lowbit-results/ or wherever OUT.json says).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from lowbit.kernels.gemm import triton_gemm as wg
from lowbit.kernels.gemm.check import tolerance
from lowbit.kernels.gemm.cuda_gemm import CudaConfig
from lowbit.kernels.gemm.dispatch import ViaA16, linear_via_a16
from lowbit.kernels.gemm.tiled import TiledConfig
from lowbit.kernels.gemm.triton_gemm import GemmConfig, random_weight
from lowbit.tools.bench.attention import graph_time_ms, n_buffers

SHAPES = [("gate/up", 4096, 14336), ("down", 14336, 4096), ("qkv/o", 4096, 4096)]


def small_configs(w4: bool):
    out = []
    for bn, bk, sk, st, nw in ((16, 256, 1, 3, 4), (16, 256, 4, 3, 4), (16, 512, 2, 2, 4), (32, 256, 1, 3, 4),
                               (32, 256, 2, 3, 4), (32, 256, 4, 3, 4), (32, 512, 1, 2, 4), (32, 512, 4, 2, 4),
                               (64, 128, 1, 4, 4), (64, 128, 4, 4, 4), (64, 256, 2, 3, 4), (16, 128, 8, 4, 4),
                               (16, 256, 4, 3, 2), (32, 128, 4, 4, 2)):
        out.append(GemmConfig(BM=16, BN=bn, BK=bk, SPLIT_K=sk, num_warps=nw, num_stages=st,
                              unpack="pairs" if w4 else "reshape"))
    if w4:
        out += [GemmConfig(BM=16, BN=32, BK=256, SPLIT_K=4, num_stages=3, unpack="reshape"),
                GemmConfig(BM=16, BN=16, BK=256, SPLIT_K=4, num_stages=3, unpack="reshape")]
    return out


def big_configs(w4: bool, a8: bool):
    out = []
    for bm, bn, bk, nw, st in ((64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 4),
                               (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (128, 256, 128, 8, 3), (256, 128, 64, 8, 3)):
        if a8 and bk < 128:
            continue
        out.append(GemmConfig(BM=bm, BN=bn, BK=bk, num_warps=nw, num_stages=st,
                              unpack="pairs" if (w4 and not a8) else "reshape"))
    if a8:
        out += [GemmConfig(BM=128, BN=128, BK=128, num_warps=8, num_stages=3, fused_aq=False),
                GemmConfig(BM=128, BN=256, BK=128, num_warps=8, num_stages=3, fused_aq=False)]
    return out


def gemv_configs(M: int):
    bm = 1 if M == 1 else (2 if M == 2 else 4)
    return [wg.GemvConfig(BM=bm, BN=bn, GPT=g, SPLIT_K=sk, num_warps=nw, num_stages=st)
            for bn, g, sk, nw, st in ((16, 1, 1, 4, 3), (32, 1, 1, 4, 3), (64, 1, 1, 4, 3), (16, 2, 1, 4, 3),
                                      (32, 2, 1, 4, 2), (16, 1, 2, 4, 3), (32, 1, 2, 4, 3), (16, 2, 4, 4, 2),
                                      (8, 2, 1, 2, 3), (16, 4, 1, 4, 2), (32, 4, 1, 8, 2), (64, 2, 1, 8, 2),
                                      (16, 1, 1, 2, 4), (32, 2, 2, 4, 3))]


def explore_gemv(rows, log):
    t0 = time.time()
    for scheme in ("w4a16-g128", "w8a16"):
        for shape, K, N in SHAPES + [("k/v", 4096, 1024)]:
            for M in (1, 2, 4):
                rows.append(explore_cell(scheme, shape, K, N, M, gemv_configs(M), "gemv", log, t0))


def final_configs(M: int):
    """The split-unpack dot and the split GEMV (4-bit), added after the first two explorations."""
    out = [GemmConfig(BM=16, BN=bn, BK=bk, SPLIT_K=sk, num_warps=nw, num_stages=st, unpack="split")
           for bn, bk, sk, nw, st in ((32, 128, 1, 4, 4), (32, 256, 1, 4, 3), (64, 128, 1, 4, 4), (32, 128, 4, 4, 4),
                                      (64, 256, 2, 4, 3), (32, 256, 4, 4, 3), (16, 256, 4, 4, 3), (64, 128, 4, 8, 4))]
    if M <= 4:
        bm = 1 if M == 1 else 4
        out += [wg.GemvConfig(BM=bm, BN=bn, GPT=g, SPLIT_K=sk, num_warps=nw, num_stages=st)
                for bn, g, sk, nw, st in ((16, 1, 1, 4, 3), (32, 1, 1, 4, 3), (16, 2, 4, 4, 2), (32, 2, 2, 4, 3),
                                          (64, 1, 1, 4, 3), (16, 1, 4, 2, 3), (32, 1, 4, 4, 3), (64, 2, 1, 8, 2))]
    return out


def explore_final(rows, log):
    t0 = time.time()
    for shape, K, N in SHAPES:
        for M in (1, 2, 4, 16):
            cfgs = [c for c in final_configs(M) if not (isinstance(c, wg.GemvConfig) and c.BM < M)]
            rows.append(explore_cell("w4a16-g128", shape, K, N, M, cfgs, "final", log, t0))


def timed(fns):
    try:
        return graph_time_ms(fns, reps=3, target_ms=10)
    except Exception as e:  # a config the device cannot run (shared memory): recorded, not fatal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def sets(scheme, N, K, M):
    pw = [random_weight(scheme, N, K, "cuda", seed=i) for i in range(n_buffers(
        random_weight(scheme, N, K, "cuda").nbytes(), 24e9))]
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n_buffers(N * K * 2, 24e9))]
    n = max(len(pw), len(ws))
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    return pw, ws, xs, n


def explore_cell(scheme, shape, K, N, M, cfgs, tag, log, t0, *, dequant=False) -> dict:
    """One (scheme, shape, M) row: cuBLAS bf16, every config (GemmConfig or GemvConfig) checked against the
    twin on fresh inputs and timed, and dequantize + cuBLAS if asked; the best that passed (rel L2 < 1e-3)."""
    pw, ws, xs, n = sets(scheme, N, K, M)
    bf16 = timed([(lambda w=ws[i % len(ws)], x=xs[i]: F.linear(x, w)) for i in range(n)])
    ref = wg.linear_twin(xs[0], pw[0], torch.float32).double()
    cands, rels = {}, {}
    for cfg in cfgs:
        fn = wg.gemv if isinstance(cfg, wg.GemvConfig) else wg.linear
        if isinstance(cfg, CudaConfig):
            from lowbit.kernels.gemm import cuda_gemm as weight_cuda

            fn = weight_cuda.linear
        if isinstance(cfg, TiledConfig):
            from lowbit.kernels.gemm import tiled as weight_tiled

            fn = weight_tiled.linear
        if isinstance(cfg, ViaA16):
            fn = linear_via_a16
        name = f"a16-xq:{cfg.name}" if isinstance(cfg, ViaA16) else cfg.name
        try:
            y = fn(xs[0], pw[0], cfg, torch.float32).double()
            rels[name] = float((y - ref).norm() / ref.norm())
        except Exception as e:
            rels[name] = f"{type(e).__name__}: {str(e)[:80]}"
        cands[name] = timed([(lambda p=pw[i % len(pw)], x=xs[i], c=cfg, f=fn: f(x, p, c)) for i in range(n)])
    if dequant:
        cands["dequant-cublas"] = timed([(lambda p=pw[i % len(pw)], x=xs[i]: wg.linear_dequant_cublas(x, p))
                                         for i in range(n)])
    # dequantize + cuBLAS rounds the weight to bf16 first: its own bound (the audit's)
    ok = {k: v for k, v in cands.items() if isinstance(v, float) and (k == "dequant-cublas" or (
        isinstance(rels.get(k), float) and rels[k] < tolerance(k)))}
    best = min(ok, key=ok.get) if ok else None
    log(f"{tag} {scheme:<11} {shape:<8} M={M:<5} bf16 {bf16 * 1e3:7.1f} us  best "
        + (f"{ok[best] * 1e3:7.1f} us x{bf16 / ok[best]:.2f} {best}" if best else "none") + f"  [{time.time() - t0:.0f}s]")
    del pw, ws, xs
    torch.cuda.empty_cache()
    return {"scheme": scheme, "shape": shape, "M": M, "N": N, "K": K, "bf16_ms": bf16, "best": best,
            "best_ms": ok.get(best), "ratio": bf16 / ok[best] if best else None, "candidates": cands, "rel_l2": rels}


CUDA_SHAPES = SHAPES + [("k/v", 4096, 1024)]


def cuda_configs():
    """Launch geometries of the CUDA small-M kernel (RT row tiles per warp, warps per block, split-K; 0 = auto)."""
    auto = [CudaConfig(rt, w, 0, wv) for rt, w, wv in ((1, 4, 2), (2, 4, 2), (4, 4, 2), (1, 8, 2), (2, 8, 2),
                                                       (1, 4, 4), (2, 4, 4), (4, 4, 4), (2, 8, 4))]
    return auto + [CudaConfig(rt, w, sk) for rt, w, sk in ((1, 4, 1), (2, 4, 4), (2, 4, 8), (1, 4, 8), (4, 4, 4),
                                                           (2, 8, 4))]


def explore_cuda(rows, log):
    """The CUDA kernel vs the tabled Triton cell and cuBLAS bf16 per (scheme, shape, M <= 16)."""
    from lowbit.kernels.gemm.dispatch import Dispatch

    table = Dispatch.for_device("cuda")
    t0 = time.time()
    for scheme in ("w4a16-g128", "w8a16", "w4a16-g64-asym"):
        kind = "w4a16" if scheme.startswith("w4") else "w8a16"
        for shape, K, N in CUDA_SHAPES:
            for M in (1, 2, 4, 8, 16):
                cfgs = cuda_configs()
                cur = table.choose(kind, M)  # the cell the committed table runs here (no pw: not a CUDA one)
                if cur.config is not None and cur.path != "cuda":
                    cfgs.append(cur.config)
                rows.append(explore_cell(scheme, shape, K, N, M, cfgs, "cuda", log, t0))
    log(cuda_ratio_table(rows))


def explore_cuda_quick(rows, log):
    """--cuda at the table's representative M (1, 4, 16, 64; and 32) for w4a16-g128 and w8a16: the launch
    geometries re-timed after a kernel change, beside the tabled Triton cell (and dequantize + cuBLAS above
    M = 16, where the kernel's 4 / 8 activation tiles compete with it)."""
    from lowbit.kernels.gemm.dispatch import Dispatch

    table = Dispatch.for_device("cuda")
    t0 = time.time()
    for scheme in ("w4a16-g128", "w8a16"):
        kind = "w4a16" if scheme.startswith("w4") else "w8a16"
        for shape, K, N in CUDA_SHAPES:
            for M in (1, 4, 16, 32, 64):
                cfgs = [c for c in cuda_configs() if M <= 16 or c.RT <= 2]  # RT 4: M <= 16 only
                cur = table.choose(kind, M)
                if cur.config is not None and cur.path != "cuda":
                    cfgs.append(cur.config)
                rows.append(explore_cell(scheme, shape, K, N, M, cfgs, "cuda", log, t0, dequant=M > 16))
    log(cuda_ratio_table(rows))


def ws_configs():
    """The warp-split kernel's instances (RT, NB) x warps per block, split-K automatic; and W 8 RT 1 NB 4 with fixed
    splits."""
    inst = ((1, 3), (1, 4), (1, 6), (2, 3), (2, 4))
    return ([CudaConfig(rt, w, 0, NB=nb) for rt, nb in inst for w in (4, 8, 16)]
            + [CudaConfig(1, 8, sk, NB=4) for sk in (1, 2, 4)] + [CudaConfig(1, 8, 0, 4, NB=4)]
            + [CudaConfig(2, w, 4, NB=3) for w in (4, 8)])


# the runtime's fused projections (runtime.fuse) of the 8B geometry: q|k|v and gate|up as one GEMM each
FUSED_SHAPES = [("qkv fused", 4096, 6144), ("gate|up fused", 4096, 28672)]


def explore_cuda_ws(rows, log):
    """--cuda-ws: the warp-split kernel (4-bit, M <= 8) beside the x-staging kernel's tabled config, with cuBLAS bf16
    on a weight of the packed one's bytes (N / 4 rows) as the bandwidth reference, per (scheme, shape, M)."""
    from lowbit.kernels.gemm import cuda_gemm as weight_cuda

    t0 = time.time()
    for scheme in ("w4a16-g128", "w4a16-g64-asym"):
        for shape, K, N in CUDA_SHAPES + FUSED_SHAPES:
            for M in (1, 2, 4, 8, 16):
                cfgs = [CudaConfig(2, 8, 0) if M <= 8 else CudaConfig(1, 8, 0),
                        *(c for c in ws_configs() if M <= 8 or (c.RT, c.NB) in weight_cuda.WARP_SPLIT_SHAPES_MT2)]
                row = explore_cell(scheme, shape, K, N, M, cfgs, "cuda-ws", log, t0)
                pw = random_weight(scheme, N, K, "cuda")
                row["blocks_per_sm"] = {c.name: weight_cuda.warp_split_occupancy(pw, M, c, "cuda") for c in cfgs if c.NB}
                del pw
                if M == 1:
                    ws = [torch.randn(N // 4, K, device="cuda", dtype=torch.bfloat16) for _ in range(n_buffers(
                        N // 4 * K * 2, 24e9))]
                    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
                    row["bf16_quarter_ms"] = timed([(lambda w=w, x=x: F.linear(x, w)) for w in ws])
                    log(f"  cuBLAS bf16 on N/4 = {N // 4} rows (the W4 bytes): {row['bf16_quarter_ms'] * 1e3:.1f} us")
                    del ws
                rows.append(row)


def explore_cuda_ws16(rows, log):
    """--cuda-ws16: the 9-16 bucket (M = 16) only: the warp-split kernel with two activation tiles (its MT 2
    instances) beside the x-staging kernel's launches, every one with programmatic dependent launch as the table's
    CUDA cells run, W4A16 g128 and g64-asym on the 8B and fused shapes."""
    from dataclasses import replace

    from lowbit.kernels.gemm import cuda_gemm as weight_cuda

    t0 = time.time()
    xs = [CudaConfig(1, 8, 0), CudaConfig(2, 8, 0), CudaConfig(1, 4, 0)]
    ws = [c for c in ws_configs() if (c.RT, c.NB) in weight_cuda.WARP_SPLIT_SHAPES_MT2]
    cfgs = [replace(c, pdl=True) for c in xs + ws]
    for scheme in ("w4a16-g128", "w4a16-g64-asym"):
        for shape, K, N in CUDA_SHAPES + FUSED_SHAPES:
            row = explore_cell(scheme, shape, K, N, 16, cfgs, "cuda-ws", log, t0)
            pw = random_weight(scheme, N, K, "cuda")
            row["blocks_per_sm"] = {c.name: weight_cuda.warp_split_occupancy(pw, 16, c, "cuda") for c in cfgs if c.NB}
            del pw
            rows.append(row)


def explore_cuda_lb(rows, log):
    """--cuda-lb: the warp-split kernel's instances under launch bound 256 (CudaConfig.bound: up to 255 registers a
    thread, at most 8 warps) beside the same launches under the default bound 512 (128 registers, where the RT 2 and
    two-activation-tile instances spill), and at M 16 the RT 4 instance (bound 256 only), W4A16 g128 at M 1 / 4 / 16 on
    the 8B and fused shapes, with PDL as the table's cells run; blocks per SM recorded for each."""
    from dataclasses import replace

    from lowbit.kernels.gemm import cuda_gemm as weight_cuda

    t0 = time.time()
    for M in (1, 4, 16):
        shapes = weight_cuda.WARP_SPLIT_SHAPES_MT2 if M > 8 else weight_cuda.WARP_SPLIT_SHAPES
        base = [CudaConfig(rt, w, 0, NB=nb, pdl=True) for rt, nb in sorted(shapes) for w in (4, 8)]
        cfgs = base + [replace(c, bound=256) for c in base]
        if M > 8:  # 64 weight rows per warp, an instance of bound 256 only
            cfgs += [CudaConfig(rt, w, 0, NB=nb, pdl=True, bound=256)
                     for rt, nb in sorted(weight_cuda.WARP_SPLIT_SHAPES_MT2_LB256) for w in (4, 8)]
        for shape, K, N in CUDA_SHAPES + FUSED_SHAPES:
            row = explore_cell("w4a16-g128", shape, K, N, M, cfgs, "cuda-lb", log, t0)
            pw = random_weight("w4a16-g128", N, K, "cuda")
            row["blocks_per_sm"] = {c.name: weight_cuda.warp_split_occupancy(pw, M, c, "cuda") for c in cfgs}
            del pw
            rows.append(row)


def explore_cuda_pdl(rows, log):
    """--cuda-pdl: W4A16 g128 through the CUDA kernels' best launches with and without programmatic dependent launch
    (CudaConfig.pdl: the weight's first lines prefetched into L2 and the launch overlapped with the previous kernel's
    tail; in this harness the previous kernel is the same linear on another weight set, as for consecutive linears).
    M 1 / 4 / 8: the warp-split kernel; 16 / 32: the x-staging one."""
    from dataclasses import replace

    ws = [CudaConfig(2, 4, 0, NB=3), CudaConfig(2, 8, 0, NB=3), CudaConfig(1, 8, 0, NB=4), CudaConfig(1, 8, 1, NB=4),
          CudaConfig(1, 8, 0, NB=6), CudaConfig(1, 8, 0, NB=3), CudaConfig(1, 8, 0, 4, NB=4)]
    xs = [CudaConfig(1, 8, 0), CudaConfig(2, 8, 0), CudaConfig(1, 4, 0)]
    t0 = time.time()
    for shape, K, N in CUDA_SHAPES + FUSED_SHAPES:
        for M in (1, 4, 8, 16, 32):
            base = ws if M <= 8 else xs
            cfgs = [c for b in base for c in (b, replace(b, pdl=True))]
            rows.append(explore_cell("w4a16-g128", shape, K, N, M, cfgs, "cuda-pdl", log, t0))


def explore_a8(rows, log):
    """A8 weights at the table's representative M: the tabled int8 cell beside a16-xq through each A16 cell the
    table has for the same weight bits at that M (the CUDA kernel first where it takes the weight)."""
    from lowbit.kernels.gemm.dispatch import Dispatch, as_a16, takes

    table = Dispatch.for_device("cuda")
    t0 = time.time()
    for scheme in ("w8a8", "w4a8-g128"):
        kind, a16 = scheme[:4], f"w{scheme[1]}a16"
        for shape, K, N in SHAPES:
            pw16 = as_a16(random_weight(scheme, N, K, "cuda"))
            for M in (1, 4, 16, 32, 64, 256, 1024, 4096):
                native = table.choose(kind, M)
                cfgs = [native.config] if native.path == "triton" else []
                for c in table.cells:
                    via = ViaA16(c.path, c.config)
                    if c.kind == a16 and c.covers(M) and takes(c, pw16, torch.bfloat16, M) and via not in cfgs:
                        cfgs.append(via)
                rows.append(explore_cell(scheme, shape, K, N, M, cfgs, "a8", log, t0))


def explore_a8_split(rows, log):
    """W8A8's int8 kernel at M 16-256 with split-K (the 4096-wide outputs fill 32 of 132 SMs with 128-wide
    tiles and one split) and tiles sized to M, activation quantization as its own launch."""
    t0 = time.time()
    for shape, K, N in SHAPES:
        for M in (16, 32, 64, 256):
            tiles = {16: ((16, 64, 4), (32, 64, 4)), 32: ((32, 64, 4), (32, 128, 4)),
                     64: ((64, 64, 4), (64, 128, 4)), 256: ((64, 128, 4), (128, 128, 8))}[M]
            cfgs = [GemmConfig(BM=bm, BN=bn, BK=128, SPLIT_K=sk, num_warps=nw, num_stages=3, fused_aq=False)
                    for bm, bn, nw in tiles for sk in (1, 2, 4, 8)]
            rows.append(explore_cell("w8a8", shape, K, N, M, cfgs, "a8-split", log, t0))


def explore_a8_retime(rows, log):
    """--a8-retime: W8A8's int8 kernel after its weight tile went straight into the dot (before, it went through
    int32 registers and was stored back for the dot): every M the table's W8A8 buckets are built from, with the tiles
    and splits a8-split explored at M <= 256 and, at M >= 256, the 128-row tiles with deeper pipelines, 256-wide tiles
    and BK 256, activation quantization as its own launch (the fused form was 4-5x slower), on the 8B and fused
    shapes."""
    t0 = time.time()
    tiles = {16: ((16, 64, 4), (32, 64, 4)), 32: ((32, 64, 4), (32, 128, 4)), 64: ((64, 64, 4), (64, 128, 4)),
             256: ((64, 128, 4), (128, 128, 8))}
    big = ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (128, 256, 128, 8, 4),
           (256, 128, 128, 8, 3), (256, 128, 128, 8, 4), (128, 128, 256, 8, 3), (64, 128, 128, 4, 4))
    for shape, K, N in CUDA_SHAPES + FUSED_SHAPES:
        for M in (16, 32, 64, 256, 1024, 4096):
            cfgs = [GemmConfig(BM=bm, BN=bn, BK=128, SPLIT_K=sk, num_warps=nw, num_stages=3, fused_aq=False)
                    for bm, bn, nw in tiles.get(M, ()) for sk in (1, 2, 4, 8)]
            if M >= 256:
                cfgs += [c for c in (GemmConfig(BM=bm, BN=bn, BK=bk, num_warps=nw, num_stages=st, fused_aq=False)
                                     for bm, bn, bk, nw, st in big) if c not in cfgs]
            rows.append(explore_cell("w8a8", shape, K, N, M, cfgs, "a8-retime", log, t0))


def explore_a8_tma(rows, log):
    """--a8-tma: W8A8 through TMA descriptors (GemmConfig.tma, _w8a8_tma_kernel) beside the table's non-TMA tiles
    re-timed in the same process, at every M the table's W8A8 buckets are built from, on the 8B and fused shapes."""
    t0 = time.time()
    plain = {16: ((16, 64, 128, 4, 3, 1), (16, 64, 128, 4, 3, 8)), 32: ((32, 128, 128, 4, 3, 1), (32, 64, 128, 4, 3, 4)),
             64: ((64, 64, 128, 4, 3, 1), (64, 64, 128, 4, 3, 8)), 256: ((128, 128, 128, 8, 3, 1), (64, 128, 128, 4, 4, 1)),
             1024: ((128, 128, 128, 8, 3, 1),), 4096: ((128, 128, 128, 8, 3, 1),)}
    tma = {16: ((16, 64, 128, 4, 3), (64, 64, 128, 4, 4)), 32: ((32, 64, 128, 4, 3), (64, 64, 128, 4, 4)),
           64: ((64, 64, 128, 4, 4), (64, 128, 128, 4, 4))}
    big = ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (128, 256, 128, 8, 4),
           (256, 128, 128, 8, 3), (64, 128, 128, 4, 4), (64, 256, 128, 8, 4))
    for shape, K, N in CUDA_SHAPES + FUSED_SHAPES:
        for M in (16, 32, 64, 256, 1024, 4096):
            cfgs = [GemmConfig(BM=bm, BN=bn, BK=bk, SPLIT_K=sk, num_warps=nw, num_stages=st, fused_aq=False)
                    for bm, bn, bk, nw, st, sk in plain[M]]
            cfgs += [GemmConfig(BM=bm, BN=bn, BK=bk, num_warps=nw, num_stages=st, fused_aq=False, tma=True)
                     for bm, bn, bk, nw, st in tma.get(M, big)]
            rows.append(explore_cell("w8a8", shape, K, N, M, cfgs, "a8-tma", log, t0))


def swap_configs(M: int, w4: bool):
    """Swapped-operand A16 tiles (the weight rows as the dot's M side: 64 per 4-warp warpgroup) for M; BM is the
    activation rows, the smallest of 16, 32, 64, 128 that holds M (128 above)."""
    bm = min(128, max(16, 1 << (M - 1).bit_length()))
    unpack = "pairs" if w4 else "reshape"
    out = [GemmConfig(BM=bm, BN=bn, BK=bk, SPLIT_K=sk, num_warps=nw, num_stages=st, unpack=unpack, swap=True)
           for bn, bk, sk, nw, st in ((64, 128, 1, 4, 4), (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (64, 256, 2, 4, 3),
                                      (128, 128, 1, 8, 3), (128, 128, 2, 8, 3), (128, 64, 4, 8, 4), (128, 128, 4, 4, 3),
                                      (64, 64, 4, 4, 5))]
    if w4:
        out.append(GemmConfig(BM=bm, BN=64, BK=128, SPLIT_K=2, num_warps=4, num_stages=4, unpack="reshape", swap=True))
    return out


def explore_swap(rows, log, save):
    """Swapped-operand A16 configs at M 4-1024 for w4a16-g128 and w8a16 on the 8B shapes, beside the cell the
    committed table runs there and dequantize + cuBLAS above M = 16; `save` after every row (a call cut short
    keeps what it timed)."""
    from lowbit.kernels.gemm.dispatch import Dispatch

    table = Dispatch.for_device("cuda")
    t0 = time.time()
    for M in (16, 64, 32, 256, 4, 128, 1024):
        for scheme in ("w4a16-g128", "w8a16"):
            kind = "w4a16" if scheme.startswith("w4") else "w8a16"
            for shape, K, N in SHAPES:
                cfgs = swap_configs(M, scheme.startswith("w4"))
                cur = table.choose(kind, M)
                if cur.config is not None:
                    cfgs.append(cur.config)
                rows.append(explore_cell(scheme, shape, K, N, M, cfgs, "swap", log, t0, dequant=M > 16))
                save()


def tiled_configs(M: int):
    """The tiled W4A16 kernel's instances (split-K automatic): exact, and folded (-bw: the weight rounded to bf16);
    the 64-activation-row-a-warp tiles from M 33, the 128 x 128 one from M 64."""
    cfgs = [TiledConfig(8, 1, 1, 4, 3), TiledConfig(4, 2, 2, 4, 3), TiledConfig(4, 2, 1, 4, 3),
            TiledConfig(8, 1, 1, 4, 3, fold=True), TiledConfig(4, 2, 2, 4, 3, fold=True)]
    if M > 32:
        cfgs += [TiledConfig(8, 1, 1, 8, 3, fold=True), TiledConfig(4, 1, 2, 8, 3, fold=True)]
    if M >= 64:
        cfgs += [TiledConfig(4, 2, 2, 8, 2, fold=True)]
    return cfgs


def wgmma_configs(M: int):
    """The tiled kernel's wgmma instances (sm_90a, folded; weight_tiled.TILES_WG): 64 activation rows a block from
    M 17, 128 from M 65."""
    from lowbit.kernels.gemm.tiled import TILES_WG

    return [TiledConfig(*t[:5], fold=True, wg=t[5]) for t in sorted(TILES_WG) if M > 64 or t[3] * 8 <= 64]


def explore_cuda_tiled(rows, log, wgmma: bool = False):
    """--cuda-tiled: the tiled W4A16 kernel (weight rows x activation rows, lowbit.kernels.gemm.tiled) at M 17-1024
    beside the cell the committed table runs there and dequantize + cuBLAS, on the 8B shapes and the runtime's fused
    projections, g128 and g64-asym."""
    from lowbit.kernels.gemm.dispatch import Dispatch

    table = Dispatch.for_device("cuda")
    t0 = time.time()
    for scheme in ("w4a16-g128", "w4a16-g64-asym"):
        for shape, K, N in CUDA_SHAPES + FUSED_SHAPES:
            for M in (17, 32, 64, 128, 256, 1024, 4096):
                cfgs = wgmma_configs(M) if wgmma else tiled_configs(M)
                cur = table.choose("w4a16", M)  # shape-free cell of the committed table
                if cur.config is not None:
                    cfgs.append(cur.config)
                rows.append(explore_cell(scheme, shape, K, N, M, cfgs, "cuda-wgmma" if wgmma else "cuda-tiled", log, t0,
                                         dequant=True))


def cuda_ratio_table(rows) -> str:
    """One line per (scheme, shape): speed-up over bf16 of the best CUDA config and of the Triton cell, per M."""
    out, by = [], {}
    for r in rows:
        by.setdefault((r["scheme"], r["shape"]), []).append(r)
    ms = sorted({r["M"] for r in rows})
    out.append(f"{'scheme':<15} {'shape':<8} " + " ".join(f"{'M=' + str(m):>15}" for m in ms) + "   (cuda / triton x bf16)")
    for (scheme, shape), rs in by.items():
        cells = []
        for m in ms:
            r = next((x for x in rs if x["M"] == m), None)
            if r is None:
                cells.append(f"{'-':>15}")
                continue
            ok = {k: v for k, v in r["candidates"].items() if isinstance(v, float) and isinstance(r["rel_l2"].get(k), float)
                  and r["rel_l2"][k] < 1e-3}
            cu = [v for k, v in ok.items() if k.startswith("cuda-")]
            tr = [v for k, v in ok.items() if not k.startswith("cuda-")]
            cu_s, tr_s = (f"{r['bf16_ms'] / min(v):.2f}" if v else "--" for v in (cu, tr))
            cells.append(f"{cu_s + ' / ' + tr_s:>15}")
        out.append(f"{scheme:<15} {shape:<8} " + " ".join(cells))
    return "\n".join(out)


def explore(rows, log):
    t0 = time.time()
    for scheme in ("w4a16-g128", "w8a16", "w8a8"):
        w4, a8 = scheme.startswith("w4"), scheme.endswith("a8")
        for shape, K, N in SHAPES:
            for M in (1, 4, 16, 64, 256, 1024, 4096):
                if a8 and M < 16:
                    continue
                cfgs = small_configs(w4) if M <= 16 else big_configs(w4, a8)
                rows.append(explore_cell(scheme, shape, K, N, M, cfgs, "explore", log, t0, dequant=not a8))


def gemlite_rows(rows, log):
    import os

    import gemlite
    from gemlite.helper import A16W4_HQQ_INT, A16W8_INT8, A8W8_INT8_dynamic

    cfg = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
    gemlite.load_config(cfg)  # no H200 file ships; the H100's autotune results (same SM)
    for scheme, shape, K, N in [(s, sh, k, n) for s in ("w4a16-g128", "w8a16", "w8a8") for sh, k, n in SHAPES[:2]]:
        for M in (1, 4, 16, 64, 256, 1024, 4096):
            n = 4
            layers, pw0 = [], None
            for i in range(n):
                if scheme == "w4a16-g128":
                    pw = random_weight(scheme, N, K, "cuda", seed=i)
                    pw0 = pw if i == 0 else pw0
                    codes = wg.unpack_int4_k(pw.qweight, K)
                    s = pw.scale.t().contiguous()  # [N, G]
                    lay = A16W4_HQQ_INT(device="cuda", dtype=torch.bfloat16).from_weights(
                        codes, s, torch.full_like(s, 8.0))
                else:
                    lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
                    lay = (A16W8_INT8 if scheme == "w8a16" else A8W8_INT8_dynamic)(device="cuda",
                                                                                  dtype=torch.bfloat16).from_linear(lin)
                layers.append(lay)
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
            rel = None
            if scheme == "w4a16-g128":
                ref = wg.linear_twin(xs[0], pw0, torch.float32)
                y = layers[0](xs[0]).float()
                rel = float((y - ref).norm() / ref.norm())
            ms = timed([(lambda l=layers[i], x=xs[i]: l(x)) for i in range(n)])
            rows.append({"lib": "gemlite " + gemlite.__version__, "scheme": scheme, "shape": shape, "M": M, "N": N,
                         "K": K, "ms": ms, "rel_l2_vs_lowbit_twin": rel})
            log(f"gemlite {scheme:<11} {shape:<8} M={M:<5} {ms if isinstance(ms, str) else f'{ms * 1e3:7.1f} us'}"
                + (f" rel {rel:.2e}" if rel is not None else ""))
            del layers, xs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    out = sys.argv[1]
    res = {"env": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}, "explore": [], "gemlite": [],
           "gemv": []}
    try:
        if "--cuda" in sys.argv:
            explore_cuda(res["explore"], print)
        if "--cuda-pdl" in sys.argv:
            explore_cuda_pdl(res["explore"], print)
        if "--cuda-ws" in sys.argv:
            explore_cuda_ws(res["explore"], print)
        if "--cuda-ws16" in sys.argv:
            explore_cuda_ws16(res["explore"], print)
        if "--cuda-lb" in sys.argv:
            explore_cuda_lb(res["explore"], print)
        if "--cuda-quick" in sys.argv:
            explore_cuda_quick(res["explore"], print)
        if "--cuda-tiled" in sys.argv:
            explore_cuda_tiled(res["explore"], print)
        if "--cuda-wgmma" in sys.argv:
            explore_cuda_tiled(res["explore"], print, wgmma=True)
        if "--final" in sys.argv:
            explore_final(res["explore"], print)
        if "--a8" in sys.argv:
            explore_a8(res["explore"], print)
        if "--a8-split" in sys.argv:
            explore_a8_split(res["explore"], print)
        if "--a8-retime" in sys.argv:
            explore_a8_retime(res["explore"], print)
        if "--a8-tma" in sys.argv:
            explore_a8_tma(res["explore"], print)
        def save():
            with open(out, "w") as f:
                json.dump(res, f, indent=1)
        if "--swap" in sys.argv:
            explore_swap(res["explore"], print, save)
        if "--gemv" in sys.argv:
            explore_gemv(res["gemv"], print)
        only = ("--gemv", "--final", "--cuda", "--cuda-tiled", "--cuda-wgmma", "--cuda-ws", "--cuda-ws16", "--cuda-lb", "--cuda-pdl", "--cuda-quick", "--a8", "--a8-split",
                "--a8-retime", "--a8-tma", "--swap")
        if "--no-explore" not in sys.argv and not any(a in sys.argv for a in only):
            explore(res["explore"], print)
        if "--no-gemlite" not in sys.argv and not any(a in sys.argv for a in only):
            try:
                gemlite_rows(res["gemlite"], print)
            except Exception as e:
                import traceback

                traceback.print_exc()
                res["gemlite_error"] = f"{type(e).__name__}: {e}"
    finally:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
