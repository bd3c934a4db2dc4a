"""The tiled CUDA C++ 4-bit weight kernel (lowbit.kernels.gemm.tiled) against the torch twin.

CPU: the .cu compiles with nvcc (one instance a code path) and its host entry points answer; names, the conditions
under which the dispatch passes the kernel over, the split plan; the kernel's index math (x staged with its swizzle,
each lane's A registers from its words, B fragments by byte-permutes, the group scale per chunk) emulated in torch
computes the twin's function on a block that runs past N and M.
GPU (marked): every instance vs `linear_twin` at M 1 .. 257 on odd shapes, split-K forced and deterministic, a
strided x, bias and fp16 scales, a CUDA graph replay, and a dispatch table's tiled cell through the audit.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.gemm import cuda_gemm as wc
from lowbit.kernels.gemm import tiled as wt
from lowbit.kernels.gemm import triton_gemm as wg
from lowbit.kernels.gemm.dispatch import Cell, Dispatch, config_from_name, last_resort
from lowbit.kernels.gemm.tiled import TiledConfig
from lowbit.kernels.gemm.triton_gemm import random_weight


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_tiled_cu_compiles_with_nvcc(tmp_path):
    if wc.nvcc_missing():
        pytest.skip(f"no nvcc here: {wc.nvcc_missing()}")
    so = wt.build("sm_90a", cache_dir=tmp_path, defines=("LOWBIT_COMPILE_CHECK",))
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    lib = wt._load(so)
    for cfg in (TiledConfig(4, 2, 2, 4, 3), TiledConfig(4, 2, 2, 8, 2, fold=True),
                TiledConfig(8, 1, 2, 8, 4, fold=True, wg=3)):
        for lw, zp in ((4, False), (2, True)):
            assert lib.lowbit_wq_tiled_smem(lw, int(zp), cfg.WN, cfg.WM, cfg.RT, cfg.MTW, cfg.STAGES, int(cfg.wg)) == \
                wt.smem_bytes(cfg, lw, zp)
    # x, ldx, qw, scale, scale_kind, zero, bias, bias_kind, y, ldy, out_kind, ws, counters, M, N, K, group, lw, wn, wm,
    # rt, mtw, stages, fold, wg, stages_per_split, splitk, pdl, l2p, stream, occupancy: refusals before any launch
    args = lambda kind, N, K, lw, wn, wg=0: (None, 0, None, None, kind, None, None, 0, None, 0, 0, None, None, 17, N, K,
                                             128, lw, wn, 1 if wg else 2, 2, 4 if not wg else 8, 4, wg, wg, 1, 1, 0,
                                             256, 0, None)
    for a, code, text in ((args(2, 16, 128, 4, 4), -3, b"bf16 or fp16"), (args(0, 16, 192, 4, 4), -4, b"multiple of 128"),
                          (args(0, 24, 128, 4, 4), -4, b"N of 16"), (args(0, 16, 128, 1, 4), -1, b"words-per-lane"),
                          (args(0, 16, 128, 4, 3), -2, b"no instance for this tile")) + (
            # where a Hopper is present the wgmma call passes this check and would launch (s24 call 1: it did, on
            # null pointers, and every later test in the process saw the illegal address)
            () if hopper else ((args(0, 16, 128, 4, 8, wg=1), -5, b"sm_90 (Hopper) only"),)):
        rc = lib.lowbit_wq_tiled(*a)
        assert rc == code and text in lib.lowbit_wq_tiled_error(rc), (a, rc)


def test_names_conditions_and_plan():
    for cfg in (TiledConfig(), TiledConfig(8, 1, 1, 4, 3, 3, pdl=False), TiledConfig(4, 1, 2, 8, 3, L2P=0, fold=True),
                TiledConfig(8, 1, 2, 16, 4, fold=True, wg=1), TiledConfig(16, 1, 1, 8, 4, fold=True, wg=3)):
        assert TiledConfig.from_name(cfg.name) == cfg and config_from_name("cuda", cfg.name) == cfg
    assert (TiledConfig().BN, TiledConfig().BM, TiledConfig(4, 2, 2, 8, 2).BM) == (128, 64, 128)
    with pytest.raises(ValueError, match="not a TiledConfig"):
        TiledConfig.from_name("cuda-tl-128x64")
    ok = random_weight("w4a16-g128", 4096, 1024, "cpu")
    assert wt.why_not(ok, M=300) is None and wt.why_not(random_weight("w4a16-g64-asym", 64, 256, "cpu")) is None
    half = random_weight("w4a16-g128", 64, 256, "cpu")
    half.scale = half.scale.half()
    assert wt.why_not(half) is None
    reasons = {
        "4-bit": wt.why_not(random_weight("w8a16", 64, 256, "cpu")),
        "groups of 64": wt.why_not(random_weight("w4a16-g32", 64, 256, "cpu")),
        "K % 128": wt.why_not(random_weight("w4a16-g64-asym", 64, 192, "cpu")),
        "N % 16 == 0": wt.why_not(random_weight("w4a16-g128", 72, 256, "cpu")),
        "bf16 activations": wt.why_not(ok, torch.float16),
        "no tiled-kernel instance": wt.why_not(ok, config=TiledConfig(4, 2, 2, 4, 5)),
        "bf16 scales when folded": wt.why_not(half, config=TiledConfig(fold=True)),
        "add -bw": wt.why_not(ok, config=TiledConfig(8, 1, 2, 16, 4, wg=1)),
        "groups in flight) wgmma": wt.why_not(ok, config=TiledConfig(4, 2, 2, 4, 3, fold=True, wg=1)),
        "instances (WN, WM, RT, MTW, STAGES, groups": wt.why_not(ok, config=TiledConfig(8, 1, 2, 16, 4, fold=True, wg=2)),
    }
    assert wt.why_not(ok, config=TiledConfig(8, 1, 2, 16, 4, fold=True, wg=1)) is None
    assert TiledConfig.from_name("cuda-tl-wn16-wm1-rt1-mt8-s4-sk0-bw-wg3-pdl").wg == 3
    assert TiledConfig.from_name("cuda-tl-wn16-wm1-rt1-mt8-s4-sk0-bw-wg-pdl").wg == 1
    assert (TiledConfig(8, 1, 2, 16, 4, wg=1).BN, TiledConfig(8, 1, 2, 16, 4, wg=1).BM) == (256, 128)
    assert TiledConfig.from_name(TiledConfig(8, 1, 1, 8, fold=True).name).fold
    assert wt.why_not(ok, config=TiledConfig(8, 1, 1, 8, 3)) is not None  # a folded-only tile asked exact
    assert wt.rounds_weight_to_bf16("cuda:" + TiledConfig(fold=True).name)
    assert not wt.rounds_weight_to_bf16(TiledConfig().name) and wt.rounds_weight_to_bf16("dequant-cublas")
    for want, got in reasons.items():
        assert got is not None and want in got and "\n" not in got, (want, got)
    # the split fills one wave of resident blocks (2 a SM), none empty, never more than the stages
    for N, K, M, cfg in ((14336, 4096, 64, TiledConfig()), (4096, 14336, 64, TiledConfig()),
                         (1024, 4096, 17, TiledConfig(8, 1, 1, 4, 3)), (4096, 4096, 1000, TiledConfig(4, 2, 2, 8, 2))):
        pw = random_weight("w4a16-g128", N, K, "cpu")
        pl = wt.plan(pw, M, cfg, 132)
        stages = K // 128
        assert 1 <= pl.splitk <= stages and (pl.splitk - 1) * pl.stages_per_split < stages <= pl.splitk * pl.stages_per_split
        assert pl.tiles * pl.splitk <= max(2 * 132, pl.tiles), (N, K, M, pl)
    assert wt.plan(random_weight("w4a16-g128", 4096, 4096, "cpu"), 64, TiledConfig(SPLITK=3), 132).splitk == 3


def test_dispatch_passes_the_tiled_cell_over_for_a_weight_it_does_not_take():
    cfg = TiledConfig()
    cells = [Cell("w4a16", 17, 256, "cuda", cfg)] + last_resort()
    d = Dispatch(cells, "test")
    if wc.nvcc_missing() is None:
        assert d.choose("w4a16", 64, random_weight("w4a16-g128", 256, 256, "cpu")).config == cfg
    assert d.choose("w4a16", 64, random_weight("w4a16-g32", 256, 256, "cpu")).path == "dequant-cublas"
    assert d.choose("w4a16", 300, random_weight("w4a16-g128", 256, 256, "cpu")).path == "dequant-cublas"


def _x_unit(lw, r, pc):
    return pc ^ (r & 3) if lw == 4 else pc ^ ((r & 1) | ((r & 2) << 2))


def _emulate_block(x, pw, cfg: TiledConfig, n_block, m_block):
    """One block of the kernel in torch, index for index as the .cu writes it: every stage's x pieces permuted into
    their (hs, row, unit) places, each lane's A registers from the words of its rows, its B registers from the unit
    of its word (its rows' shared XOR key), the mma as A[16 x 16] @ B[16 x 8] assembled from the lanes' registers,
    the group scale per chunk (exact path) or the weight rounded to bf16 (fold). -> [BM, BN] (rows past M or N are
    zero-filled / clamped, as the copies do)."""
    M, K = x.shape
    N, BN, BM, lw = pw.N, cfg.BN, cfg.BM, wt.words_per_lane(pw.group)
    ck, cps = 32 * lw, 128 // (32 * lw)
    words = pw.qweight.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(BM, BN, dtype=torch.float64)
    bf = lambda v: float(torch.tensor(v, dtype=torch.float32).to(torch.bfloat16))
    for st in range(K // 128):
        k0 = st * 128
        XP = torch.zeros(2, BM, 16, 4, dtype=torch.float64)  # the permuted buffer: [hs][row][unit][b0 lo, hi, b1 lo, hi]
        for r in range(BM):
            for pc in range(16):
                if m_block + r < M:
                    v = x[m_block + r, k0 + 8 * pc:k0 + 8 * pc + 8].double()
                    XP[0, r, _x_unit(lw, r, pc)] = v[[0, 4, 1, 5]]
                    XP[1, r, _x_unit(lw, r, pc)] = v[[2, 6, 3, 7]]
        for c in range(cps):
            grp = (k0 + c * ck) // pw.group
            for wn in range(cfg.WN):
                for wm in range(cfg.WM):
                    for rt in range(cfg.RT):
                        rows = [n_block + wn * cfg.RT * 16 + rt * 16 + i for i in range(16)]
                        z = [0 if pw.zero is None or n >= N else int(pw.zero[grp, n]) for n in rows]
                        sc = [float(pw.scale[grp, n]) if n < N else 0.0 for n in rows]
                        part = torch.zeros(16, cfg.MTW * 8, dtype=torch.float64)
                        for j in range(lw):
                            for hs in range(2):
                                A = torch.zeros(16, 16, dtype=torch.float64)
                                Bs = [torch.zeros(16, 8, dtype=torch.float64) for _ in range(cfg.MTW)]
                                for lane in range(32):
                                    gid, tig = lane >> 2, lane & 3
                                    for h in range(2):
                                        n = rows[gid + 8 * h]
                                        w = int(words[n, k0 // 8 + (c * 4 + tig) * lw + j]) if n < N else 0
                                        zz = z[gid + 8 * h]
                                        lo = [(w >> sh) & 0xF for sh in (8 * hs, 8 * hs + 4)]
                                        hi = [(w >> (sh + 16)) & 0xF for sh in (8 * hs, 8 * hs + 4)]
                                        q = [v - 8 - zz for v in (lo[0], hi[0], lo[1], hi[1])] if n < N else [0] * 4
                                        if cfg.fold:
                                            q = [bf(v * sc[gid + 8 * h]) for v in q]
                                        r_ = gid + 8 * h
                                        A[r_, 2 * tig], A[r_, 2 * tig + 1] = q[0], q[1]
                                        A[r_, 2 * tig + 8], A[r_, 2 * tig + 9] = q[2], q[3]
                                    xrow0 = wm * cfg.MTW * 8 + gid
                                    u = ((c * 4 + tig) * lw + j) ^ _x_unit(lw, xrow0, 0)
                                    for t in range(cfg.MTW):
                                        b = XP[hs, xrow0 + 8 * t, u]
                                        Bs[t][2 * tig, gid], Bs[t][2 * tig + 1, gid] = b[0], b[1]
                                        Bs[t][2 * tig + 8, gid], Bs[t][2 * tig + 9, gid] = b[2], b[3]
                                for t in range(cfg.MTW):
                                    part[:, 8 * t:8 * t + 8] += A @ Bs[t]
                        scale = torch.ones(16, dtype=torch.float64) if cfg.fold else torch.tensor(sc, dtype=torch.float64)
                        r0 = wn * cfg.RT * 16 + rt * 16
                        out[wm * cfg.MTW * 8:(wm + 1) * cfg.MTW * 8, r0:r0 + 16] += (part * scale[:, None]).t()
    return out


@pytest.mark.parametrize("scheme,N,K,cfg,M", [("w4a16-g128", 48, 256, TiledConfig(2, 1, 1, 2, 3), 11),
                                              ("w4a16-g64-asym", 32, 128, TiledConfig(2, 1, 1, 2, 3), 13),
                                              ("w4a16-g64-asym", 32, 128, TiledConfig(1, 2, 1, 1, 3, fold=True), 13)])
def test_tiled_index_math_emulated_matches_twin(scheme, N, K, cfg, M):
    """A small tile shape (the emulation takes any WN/WM/RT/MTW; the library's instances are larger) over a weight
    whose second row block runs past N and an activation block past M; the folded path against the product with
    the weight rounded to bf16."""
    pw = random_weight(scheme, N, K, "cpu", seed=K)
    x = torch.randn(M, K).bfloat16()
    ref = (x.double() @ wg.dequantize(pw).to(torch.bfloat16).double().t() if cfg.fold
           else wg.linear_twin(x, pw, torch.float32).double())
    for n_block in range(0, N, cfg.BN):
        for m_block in range(0, M, cfg.BM):
            y = _emulate_block(x, pw, cfg, n_block, m_block)
            n, m = min(cfg.BN, N - n_block), min(cfg.BM, M - m_block)
            assert rel(y[:m, :n], ref[m_block:m_block + m, n_block:n_block + n]) < 1e-6, (scheme, n_block, m_block)


def _emulate_block_wg(x, pw, cfg: TiledConfig, n_block, m_block):
    """One block of the wgmma kernel in torch, index for index as the .cu writes it: each stage's weight pieces at
    their swizzled places and x pieces at their core-matrix places (as the copies put them), each lane's A registers
    from byte tig of words 2s and 2s + 1 of its rows (the byte-permute and mask) folded with the chunk's scale and
    zero-point, B read through the descriptor (core matrix (n block, k block) at n * 2048 + k * 128), every
    warpgroup's m64 tiles times all BM rows. -> [BM, BN]"""
    M, K = x.shape
    N, BN, BM = pw.N, cfg.BN, cfg.BM
    words = pw.qweight.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(BN, BM, dtype=torch.float64)
    bf = lambda v: float(torch.tensor(v, dtype=torch.float32).to(torch.bfloat16))
    for st in range(K // 128):
        k0 = st * 128
        wsm = [0] * (BN * 16)  # the weight slot as 32-bit words
        for r in range(BN):
            for pc in range(4):
                for i in range(4):
                    n = n_block + r
                    wsm[(r * 64 + ((pc ^ ((r >> 1) & 3)) << 4)) // 4 + i] = (
                        int(words[n, k0 // 8 + pc * 4 + i]) if n < N else 0)
        xsm = torch.zeros(BM * 128, dtype=torch.float64)  # the x slot as bf16 elements
        for r in range(BM):
            for kb in range(16):
                if m_block + r < M:
                    at = ((r >> 3) * 2048 + kb * 128 + (r & 7) * 16) // 2
                    xsm[at:at + 8] = x[m_block + r, k0 + 8 * kb:k0 + 8 * kb + 8].double()
        for ch in range(2):
            grp = (k0 + 64 * ch) // pw.group
            for s in range(4 * ch, 4 * ch + 4):
                B = torch.zeros(16, BM, dtype=torch.float64)
                for kk in range(16):
                    for n in range(BM):
                        B[kk, n] = xsm[(s * 256 + (n // 8) * 2048 + (kk // 8) * 128 + (n % 8) * 16 + (kk % 8) * 2) // 2]
                for wgi in range(cfg.WN // 4):
                    for rt in range(cfg.RT):
                        A = torch.zeros(64, 16, dtype=torch.float64)
                        for wq in range(4):
                            for lane in range(32):
                                gid, tig = lane >> 2, lane & 3
                                row0 = wgi * cfg.RT * 64 + wq * 16 + gid
                                for h in range(2):
                                    r = row0 + rt * 64 + 8 * h
                                    n = n_block + r
                                    z = int(pw.zero[grp, n]) if pw.zero is not None and n < N else 0
                                    sc = float(pw.scale[grp, n]) if n < N else 0.0
                                    at = (r * 64 + (((s >> 1) ^ ((gid >> 1) & 3)) << 4) + (s & 1) * 8) // 4
                                    for kbb in range(2):
                                        byte = (wsm[at + kbb] >> (8 * tig)) & 0xFF
                                        A[16 * wq + gid + 8 * h, 8 * kbb + 2 * tig] = bf(((byte & 0xF) - 8 - z) * sc)
                                        A[16 * wq + gid + 8 * h, 8 * kbb + 2 * tig + 1] = bf(((byte >> 4) - 8 - z) * sc)
                        r0 = wgi * cfg.RT * 64 + rt * 64
                        out[r0:r0 + 64] += A @ B
    return out.t()


@pytest.mark.parametrize("scheme", ["w4a16-g128", "w4a16-g64-asym"])
def test_wgmma_index_math_emulated_matches_folded_product(scheme):
    """A one-warpgroup tile of 64 x 16 (the emulation takes any WN/RT/MTW) over a weight whose second row block runs
    past N and an activation block past M, against the product with the weight rounded to bf16."""
    cfg = TiledConfig(4, 1, 1, 2, 4, fold=True, wg=1)
    N, K, M = 80, 256, 13
    pw = random_weight(scheme, N, K, "cpu", seed=5)
    x = torch.randn(M, K).bfloat16()
    ref = x.double() @ wg.dequantize(pw).to(torch.bfloat16).double().t()
    for n_block in range(0, N, cfg.BN):
        y = _emulate_block_wg(x, pw, cfg, n_block, 0)
        n = min(cfg.BN, N - n_block)
        assert rel(y[:M, :n], ref[:, n_block:n_block + n]) < 1e-6, (scheme, n_block)


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
INSTANCES = sorted(wt.TILES)


@gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["w4a16-g128", "w4a16-g64-asym"])
@pytest.mark.parametrize("N,K", [(1008, 1024), (4096, 14336), (208, 384)])
def test_gpu_tiled_matches_twin(scheme, N, K):
    pw = random_weight(scheme, N, K, "cuda", seed=N)
    if N == 1008:
        pw.bias = torch.randn(N, device="cuda").bfloat16()
    for M in (1, 3, 17, 33, 64, 99, 130, 257):
        x = torch.randn(M, K, device="cuda").bfloat16()
        ref = wg.linear_twin(x, pw, torch.float32)
        y = wt.linear(x, pw, TiledConfig(), torch.float32)
        assert torch.isfinite(y).all(), (scheme, M)
        assert rel(y, ref) < 1e-4, (scheme, N, K, M, rel(y, ref))
        yb = wt.linear(x, pw)
        assert yb.dtype == torch.bfloat16 and rel(yb.float(), ref) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("tile,fold,wgmma", [(t, False, 0) for t in INSTANCES] +
                         [(t, True, 0) for t in sorted(wt.TILES_FOLD)] + [(t[:5], True, t[5]) for t in sorted(wt.TILES_WG)])
def test_gpu_every_instance_and_split_agree(tile, fold, wgmma):
    """Exact instances against the twin; folded ones against the product with the weight rounded to bf16 (what
    dequantize + cuBLAS multiplies), at summation-order error, and the twin at the dequantize bound."""
    N, K = 336, 1536
    for scheme in ("w4a16-g128", "w4a16-g64-asym"):
        pw = random_weight(scheme, N, K, "cuda", seed=3)
        for M in (5, 71, 130):
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = wg.linear_twin(x, pw, torch.float32)
            ref_bw = x.float() @ wg.dequantize(pw).to(torch.bfloat16).float().t()
            for sk in (0, 1, 3, 12):
                cfg = TiledConfig(*tile, SPLITK=sk, fold=fold, wg=wgmma)
                y = wt.linear(x, pw, cfg, torch.float32)
                assert torch.isfinite(y).all()
                if fold:
                    assert rel(y, ref_bw) < 1e-4 and rel(y, ref) < 1e-2, (scheme, tile, M, sk, rel(y, ref_bw))
                else:
                    assert rel(y, ref) < 1e-4, (scheme, tile, M, sk, rel(y, ref))
                assert torch.equal(y, wt.linear(x, pw, cfg, torch.float32)), "split-K sum order must be fixed"


@gpu
@needs_cuda
def test_gpu_strided_x_fp16_scales_and_no_pdl():
    pw = random_weight("w4a16-g128", 512, 1024, "cuda", seed=7)
    pw.scale = pw.scale.half()
    wide = torch.randn(40, 1024 + 64, device="cuda").bfloat16()
    x = wide[:, 32:32 + 1024]  # row stride 1088, 16-byte aligned start
    ref = wg.linear_twin(x.contiguous(), pw, torch.float32)
    for cfg in (TiledConfig(), TiledConfig(pdl=False)):
        assert rel(wt.linear(x, pw, cfg, torch.float32), ref) < 1e-4


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [TiledConfig(SPLITK=4), TiledConfig(8, 1, 2, 8, 4, SPLITK=4, fold=True, wg=3)])
def test_gpu_tiled_graph_replay(cfg):
    """Split-K forced: the workspace and the counters inside the graph."""
    pw = random_weight("w4a16-g128", 4096, 4096, "cuda")
    x = torch.randn(48, 4096, device="cuda").bfloat16()
    ref = wt.linear(x, pw, cfg)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        wt.linear(x, pw, cfg)  # warm-up on the capture stream (its counters)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            y = wt.linear(x, pw, cfg)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, wt.linear(x, pw, cfg))
    assert not torch.equal(y, ref)


@gpu
@needs_cuda
def test_gpu_audit_covers_tiled_cells():
    from lowbit.tools.audit.gemm import audit_weights

    cells = [Cell("w4a16", 17, 300, "cuda", TiledConfig())] + last_resort()
    rows, _ = audit_weights("cuda", schemes=("w4a16-g128", "w4a16-g64-asym", "w4a16-g32"),
                            shapes=[("odd", 1024, 1008), ("llama3-8b down", 14336, 4096)], ms=(17, 64, 255, 301),
                            dispatch=Dispatch(cells, "test"))
    tiled = [r for r in rows if r.kernel.startswith("cuda:cuda-tl-")]
    assert tiled and all(r.M <= 300 and not r.scheme.endswith("g32") for r in tiled)
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
