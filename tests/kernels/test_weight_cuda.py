"""The CUDA C++ small-M weight kernel (lowbit.kernels.gemm.cuda_gemm) against the torch twin.

CPU: the .cu compiles with nvcc (a few template instances, when nvcc is here), a missing nvcc is a
one-line error, the launch plan and the conditions under which the dispatch passes the kernel over.
GPU (marked): every scheme it takes vs `linear_twin` at M 1/3/4/16/17/33/64 on odd N, the launch geometries and
split-K agree, split-K is deterministic across calls, a CUDA graph replays it, the audit covers its cells.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels import nvcc
from lowbit.kernels.gemm import cuda_gemm as wc
from lowbit.kernels.gemm import triton_gemm as wg
from lowbit.kernels.gemm.cuda_gemm import CudaConfig
from lowbit.kernels.gemm.dispatch import Cell, Dispatch, config_from_name
from lowbit.kernels.gemm.triton_gemm import GemmConfig, random_weight


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_cu_compiles_with_nvcc(tmp_path):
    """Every code path of the .cu (4/8-bit, LW 4/2/1) through nvcc for sm_90a; the host entry points answer."""
    if wc.nvcc_missing():
        pytest.skip(f"no nvcc here: {wc.nvcc_missing()}")
    so = wc.build("sm_90a", cache_dir=tmp_path, defines=("LOWBIT_COMPILE_CHECK",))
    assert so.is_file() and so.parent == tmp_path and not list(tmp_path.glob("*.tmp"))
    assert wc.build("sm_90a", cache_dir=tmp_path, defines=("LOWBIT_COMPILE_CHECK",)) == so  # cached, same key
    lib = wc._load(so)
    # host-only entry points (no device needed): shared memory per block, and argument checks before any launch
    assert lib.lowbit_wq_small_m_smem(4, 1, 4, 3) == 3 * 8 * 1 * 32 * 8
    assert lib.lowbit_wq_small_m_smem(8, 9, 2, 5) == 5 * 2 * 2 * 32 * 8
    assert [lib.lowbit_wq_small_m_smem(4, m, 4, 1) for m in (8, 16, 17, 32, 33, 64)] == [
        256 * 8 * mt for mt in (1, 2, 4, 4, 8, 8)]
    assert [wc.activation_tiles(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 4, 4, 8, 8]
    # x, ldx, qw, scale, scale_kind, zero, bias, bias_kind, y, ldy, out_kind, ws, counters,
    # M=0 (refused), N, K, group, bits, lw, rt, warps, chunks_per_split, xs_chunks, splitk, pdl, stream
    rc = lib.lowbit_wq_small_m(None, 0, None, None, 0, None, None, 0, None, 0, 0, None, None,
                               0, 1, 128, 128, 4, 4, 2, 4, 1, 1, 1, 0, 0)
    assert rc == -1 and b"1 <= M <= 64" in lib.lowbit_cuda_error_string(rc)
    rc = lib.lowbit_wq_small_m(None, 0, None, None, 0, None, None, 0, None, 0, 0, None, None,
                               65, 1, 128, 128, 4, 4, 2, 4, 1, 1, 1, 0, 0)
    assert rc == -1
    rc = lib.lowbit_wq_small_m(None, 0, None, None, 0, None, None, 0, None, 0, 0, None, None,
                               1, 1, 128, 128, 4, 4, 2, 4, 1, 0, 1, 0, 0)
    assert rc == -5 and b"xs_chunks" in lib.lowbit_cuda_error_string(rc)
    assert isinstance(lib, ctypes.CDLL)


def test_missing_nvcc_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setattr(nvcc, "NVCC", str(tmp_path / "no-nvcc-here"))
    with pytest.raises(LowbitError) as e:
        wc.build("sm_90a", cache_dir=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "nvcc not found" in msg and "install the CUDA toolkit" in msg


def test_words_per_lane_and_plan():
    # 4-bit chunk = 32 * LW: g128 -> 4, g64 -> 2, g32 -> 1; 8-bit chunk = 16 * LW
    assert [wc.words_per_lane(4, 4096, g) for g in (128, 64, 32, 4096)] == [4, 2, 1, 4]
    assert [wc.words_per_lane(8, k, k) for k in (576, 1056, 1008, 1000)] == [4, 2, 1, None]  # 1000 % 16 != 0
    assert wc.words_per_lane(4, 40, 40) is None
    pw = random_weight("w4a16-g128", 14336, 4096, "cpu")
    p1 = wc.plan(pw, 1, CudaConfig(RT=2, warps=4), sms=132)
    assert p1.lw == 4 and p1.row_blocks == 112 and p1.splitk * p1.chunks_per_split >= 32
    # auto split-K keeps the grid within waves x SMs (no partial wave): 112 row blocks x 2 <= 264 < 112 x 3
    p4 = wc.plan(pw, 1, CudaConfig(RT=2, warps=4, waves=4), sms=132)
    assert p1.splitk == 2 and p4.splitk == 4 and p4.row_blocks * p4.splitk <= 4 * 132
    assert wc.plan(pw, 1, CudaConfig(RT=1, warps=8), sms=132).splitk == 2  # 112 row blocks of 128 rows: 264 // 112
    assert (p1.splitk - 1) * p1.chunks_per_split < 32  # no empty split
    down = random_weight("w8a16", 4096, 14336, "cpu")
    for M in (1, 16):  # up to M 16 the split makes x's K range one window within the shared-memory cap
        p = wc.plan(down, M, CudaConfig(RT=1, warps=4, SPLITK=1), sms=132)
        assert p.smem <= wc.SMEM_CAP and p.splitk * p.chunks_per_split * 64 >= 14336
        assert p.splitk > 1 and p.xs_chunks == p.chunks_per_split
    for M in (17, 64):  # above 16: windows; no split forced by shared memory
        p = wc.plan(down, M, CudaConfig(RT=1, warps=4, SPLITK=1), sms=132)
        assert p.splitk == 1 and p.chunks_per_split * 64 == 14336
        assert p.smem <= wc.SMEM_CAP and p.smem == p.xs_chunks * 4 * wc.activation_tiles(M) * 256
        assert p.xs_chunks == wc.SMEM_CAP // (1024 * wc.activation_tiles(M)) < 224  # 1 KB per chunk and tile


def test_why_not_and_dispatch_falls_through():
    pw = random_weight("w4a16-g64-asym", 33, 256, "cpu")
    assert wc.why_not(pw, torch.bfloat16, 16) is None
    assert "bf16" in wc.why_not(pw, torch.float16, 1)
    assert wc.why_not(pw, torch.bfloat16, 64) is None
    assert "M=65" in wc.why_not(pw, torch.bfloat16, 65)
    assert "A16" in wc.why_not(random_weight("w8a8", 33, 128, "cpu"))
    assert "multiple" in wc.why_not(wg.pack_weight(torch.zeros(5, 40, dtype=torch.uint8), torch.ones(5, 1), None,
                                                   bits=4, group=40, a_bits=16))
    cuda = Cell("w4a16", 1, 16, "cuda", CudaConfig())
    tri = Cell("w4a16", 1, 16, "triton", GemmConfig())
    d = Dispatch([cuda, tri], "test")
    if wc.nvcc_missing() is None:
        assert d.choose("w4a16", 3, pw, torch.bfloat16) is cuda
    assert d.choose("w4a16", 3, pw, torch.float16) is tri  # fp16 input: the next cell that covers M
    assert d.choose("w4a16", 3) is cuda  # without the weight: the table's cell
    assert config_from_name("cuda", cuda.config.name) == cuda.config and cuda.kernel == "cuda:cuda-rt2-w4-sk0"
    assert CudaConfig.from_name("cuda-rt4-w8-sk3") == CudaConfig(4, 8, 3)
    assert CudaConfig.from_name(CudaConfig(1, 4, 0, 4).name) == CudaConfig(1, 4, 0, 4)


def test_table_builder_puts_a_fallback_after_a_cuda_cell(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bwt", Path(__file__).parents[2] / "benchmarks/build_weight_table.py")
    bwt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bwt)
    rows = [{"scheme": "w4a16-g128", "shape": sh, "M": 1, "N": 8, "K": 8, "bf16_ms": 1.0,
             "candidates": {"cuda-rt2-w4-sk0": 0.25, "bm16-bn32-bk256-sk4-w4-s3-sp": 1.2},
             "rel_l2": {"cuda-rt2-w4-sk0": 1e-6, "bm16-bn32-bk256-sk4-w4-s3-sp": 1e-6}} for sh in bwt.SHAPES]
    f = tmp_path / "e.json"
    f.write_text(json.dumps({"env": {"gpu": "X"}, "explore": rows}))
    bwt.main(str(tmp_path / "t.json"), [str(f)])
    cells = [c for c in json.loads((tmp_path / "t.json").read_text())["cells"] if c["m_lo"] == 1]
    assert [(c["path"], c["config"]) for c in cells] == [("cuda", "cuda-rt2-w4-sk0"),
                                                         ("triton", "bm16-bn32-bk256-sk4-w4-s3-sp")]


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SCHEMES = ["w4a16-g128", "w4a16-g64-asym", "w4a16-g32", "w8a16"]


@gpu
@needs_cuda
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("N,K", [(1001, 1024), (1024, 4096), (4096, 14336)])
def test_gpu_cuda_matches_twin(scheme, N, K):
    pw = random_weight(scheme, N, K, "cuda", seed=N)
    if N == 1001:
        pw.bias = torch.randn(N, device="cuda").bfloat16()
    for M in (1, 3, 4, 16, 17, 33, 64):  # 1, 2, 4, 8 activation tiles; K 14336 at M > 16: several x windows
        x = torch.randn(M, K, device="cuda").bfloat16()
        ref = wg.linear_twin(x, pw, torch.float32)
        y = wc.linear(x, pw, CudaConfig(), torch.float32)
        assert torch.isfinite(y).all(), (scheme, M)
        assert rel(y, ref) < 1e-4, (scheme, M, rel(y, ref))  # exact integer weights, fp32 sums: order only
        yb = wc.linear(x, pw)
        assert yb.dtype == torch.bfloat16 and rel(yb.float(), ref) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["w4a16-g128", "w8a16"])
def test_gpu_cuda_geometries_and_split_k_agree(scheme):
    N, K, M = 333, 1536, 5
    pw = random_weight(scheme, N, K, "cuda", seed=3)
    pw.scale = pw.scale.float()  # fp32 scales are read as they are
    x = torch.randn(M, K, device="cuda").bfloat16()
    ref = wg.linear_twin(x, pw, torch.float32)
    for cfg in (CudaConfig(1, 4, 1), CudaConfig(2, 4, 3), CudaConfig(4, 2, 5), CudaConfig(1, 8, 0), CudaConfig(4, 8, 12)):
        y1 = wc.linear(x, pw, cfg, torch.float32)
        y2 = wc.linear(x, pw, cfg, torch.float32)
        assert rel(y1, ref) < 1e-4, (cfg, rel(y1, ref))
        assert torch.equal(y1, y2), cfg  # split-K sums in a fixed order; the counters reset for the next call
    x9 = torch.randn(9, K, device="cuda").bfloat16()  # 9..16: two activation tiles
    assert rel(wc.linear(x9, pw, CudaConfig(2, 4, 3), torch.float32), wg.linear_twin(x9, pw, torch.float32)) < 1e-4
    for M in (31, 57):  # four and eight tiles, one split and split-K; K 1536 = 12 chunks = 2 windows at MT 8 (w8)
        xm = torch.randn(M, K, device="cuda").bfloat16()
        refm = wg.linear_twin(xm, pw, torch.float32)
        for cfg in (CudaConfig(1, 4, 1), CudaConfig(2, 8, 5)):
            assert rel(wc.linear(xm, pw, cfg, torch.float32), refm) < 1e-4, (M, cfg)
    with pytest.raises(LowbitError, match="rows-per-warp"):
        wc.linear(torch.randn(17, K, device="cuda").bfloat16(), pw, CudaConfig(4, 4, 1))


def _graph_replays_match(x, fn, ref_fn, tol):
    """fn(x) captured in a CUDA graph (after one eager call: build, load, counters for the stream) equals ref_fn(x)
    on three fresh inputs."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            y = fn(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert rel(y.float(), ref_fn(x).float()) < tol


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay():
    pw = random_weight("w4a16-g128", 4096, 4096, "cuda")
    cfg = CudaConfig(2, 4, 4)  # split-K: the workspace and the counters inside the graph
    _graph_replays_match(torch.randn(2, 4096, device="cuda").bfloat16(), lambda x: wc.linear(x, pw, cfg),
                         lambda x: wg.linear_twin(x, pw, torch.float32), 1e-2)


@gpu
@needs_cuda
def test_gpu_audit_covers_cuda_cells():
    from lowbit.kernels.gemm.dispatch import last_resort
    from lowbit.tools.audit.gemm import audit_weights

    cells = [Cell(k, 1, 64, "cuda", CudaConfig(RT=1)) for k in ("w4a16", "w8a16")] + last_resort()
    rows, _ = audit_weights("cuda", schemes=("w4a16-g128", "w4a16-g64-asym", "w8a16"),
                            shapes=[("odd", 1024, 1001), ("smollm2 up", 576, 1536)], ms=(1, 7, 16, 17, 64, 65),
                            dispatch=Dispatch(cells, "test"))
    small = [r for r in rows if r.M <= 64]
    assert small and all(r.kernel.startswith("cuda:") for r in small)
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
    assert all(r.kernel == "dequant-cublas" for r in rows if r.M == 65)


def _emulate_warp(x, pw, lw, n0=0):
    """One warp of the kernel (RT 1, two activation tiles, one K split) in torch, index for index as the .cu
    writes it: the staged B fragments, each lane's A registers from the words it loads, the mma as
    A[16 x 16] @ B[16 x 8] assembled from the lanes' registers, the group scale per chunk. -> [M, 16]"""
    M, K = x.shape
    bits, N = pw.bits, pw.N
    kpw, spw = (8, 2) if bits == 4 else (4, 1)
    ck, S = 4 * lw * kpw, lw * spw
    if bits == 4:
        words = pw.qweight.to(torch.int64) & 0xFFFFFFFF  # [N, K/8]
    else:
        b = pw.qweight.view(torch.uint8).to(torch.int64).reshape(N, K // 4, 4)
        words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    xp = torch.zeros(16, K, dtype=torch.float64)
    xp[:M] = x.double()
    xs = torch.zeros(K // ck, S, 2, 32, 4, dtype=torch.float64)  # [chunk][step][tile][lane] (b0 lo, hi, b1 lo, hi)
    for m in range(16):
        for piece in range(K // 8):
            v = xp[m, piece * 8:piece * 8 + 8]
            t, g, c = m >> 3, m & 7, piece * 8 // ck
            kin = piece * 8 - c * ck
            if bits == 4:
                wi = kin // 8
                tg, j = wi // lw, wi % lw
                xs[c, 2 * j, t, g * 4 + tg] = v[[0, 4, 1, 5]]
                xs[c, 2 * j + 1, t, g * 4 + tg] = v[[2, 6, 3, 7]]
            else:
                for q in range(2):
                    w_ = kin // 4 + q
                    xs[c, w_ % lw, t, g * 4 + w_ // lw] = v[4 * q:4 * q + 4]
    acc = torch.zeros(16, 16, dtype=torch.float64)  # [weight row, activation row]
    for c in range(K // ck):
        grp = c * ck // pw.group
        rows = [min(n0 + r, N - 1) for r in range(16)]
        sc = torch.tensor([float(pw.scale[grp, r]) for r in rows], dtype=torch.float64)
        z = [0 if pw.zero is None else int(pw.zero[grp, r]) for r in rows]
        part = torch.zeros(16, 16, dtype=torch.float64)
        for s in range(S):
            A = torch.zeros(16, 16, dtype=torch.float64)
            for lane in range(32):
                gid, tig = lane >> 2, lane & 3
                j, hs = (s // 2, s % 2) if bits == 4 else (s, 0)
                regs = []
                for r in (gid, gid + 8):
                    w = int(words[rows[r], c * (ck // kpw) + tig * lw + j])
                    if bits == 4:  # nib_pair(w >> sh) - (136 + z): (bits 0-3, bits 16-19) of the shifted word
                        pr = [((w >> sh) & 0xF, (w >> (sh + 16)) & 0xF) for sh in (8 * hs, 8 * hs + 4)]
                        regs.append([(128 + a - 136 - z[r], 128 + b_ - 136 - z[r]) for a, b_ in pr])
                    else:  # byte i of w ^ 0x80808080, minus 128 + z
                        u = [((w ^ 0x80808080) >> (8 * i)) & 0xFF for i in range(4)]
                        regs.append([(u[0] - 128 - z[r], u[1] - 128 - z[r]), (u[2] - 128 - z[r], u[3] - 128 - z[r])])
                (A[gid, 2 * tig], A[gid, 2 * tig + 1]), (A[gid, 2 * tig + 8], A[gid, 2 * tig + 9]) = regs[0]
                (A[gid + 8, 2 * tig], A[gid + 8, 2 * tig + 1]), (A[gid + 8, 2 * tig + 8], A[gid + 8, 2 * tig + 9]) = regs[1]
            for t in range(2):
                B = torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    gid, tig = lane >> 2, lane & 3
                    b = xs[c, s, t, lane]
                    B[2 * tig, gid], B[2 * tig + 1, gid], B[2 * tig + 8, gid], B[2 * tig + 9, gid] = b
                part[:, 8 * t:8 * t + 8] += A @ B
        acc += part * sc[:, None]
    return acc[:, :M].t()


@pytest.mark.parametrize("scheme,K", [("w4a16-g128", 256), ("w4a16-g64-asym", 192), ("w4a16-g32", 96),
                                      ("w8a16", 192), ("w8a16", 80)])
def test_fragment_mapping_emulated_matches_twin(scheme, K):
    """The kernel's index math (staging permutation, A-register nibble/byte choice, per-chunk group scale)
    computes the twin's function: the CPU check of the design the GPU tests then check on the device."""
    pw = random_weight(scheme, 21, K, "cpu", seed=K)
    lw = wc.words_per_lane(pw.bits, K, pw.group)
    x = torch.randn(11, K).bfloat16()
    ref = wg.linear_twin(x, pw, torch.float32).double()
    for n0 in (0, 16):  # the second tile runs past N = 21 (rows clamped, not stored)
        y = _emulate_warp(x, pw, lw, n0)
        n = min(16, 21 - n0)
        assert rel(y[:, :n], ref[:, n0:n0 + n]) < 1e-6, (scheme, lw, n0)


def test_linear_refuses_cpu_tensors_before_any_launch():
    pw = random_weight("w4a16-g128", 33, 256, "cpu")
    with pytest.raises(ValueError, match="CUDA device"):
        wc.linear(torch.randn(2, 256).bfloat16(), pw)
    with pytest.raises(ValueError, match="M=65"):
        wc.linear(torch.randn(65, 256).bfloat16(), pw)


WS_CONFIGS = [CudaConfig(1, 4, 0, NB=3), CudaConfig(1, 8, 0, NB=4), CudaConfig(1, 16, 0, NB=6),
              CudaConfig(2, 8, 0, NB=3), CudaConfig(2, 4, 0, NB=4), CudaConfig(1, 8, 3, NB=4),
              CudaConfig(2, 4, 0, NB=3, pdl=True), CudaConfig(1, 8, 3, NB=4, pdl=True),
              # launch bound 256: the same code with up to 255 registers (no spills), at most 8 warps
              CudaConfig(2, 8, 0, NB=3, bound=256), CudaConfig(1, 4, 3, NB=4, pdl=True, bound=256),
              CudaConfig(4, 4, 0, NB=2, bound=256)]  # 64 rows per warp: M 9-16, bound 256 only


def test_warp_split_names_conditions_and_plan():
    cfg = CudaConfig(1, 8, 0, NB=4)
    assert cfg.name == "cuda-ws-rt1-w8-nb4-sk0" and CudaConfig.from_name(cfg.name) == cfg
    assert CudaConfig.from_name("cuda-ws-rt2-w16-nb3-sk2-wv4") == CudaConfig(2, 16, 2, 4, 3)
    assert config_from_name("cuda", cfg.name) == cfg
    assert CudaConfig.from_name("cuda-ws-rt2-w4-nb3-sk0-pdl") == CudaConfig(2, 4, 0, NB=3, pdl=True)
    assert CudaConfig(2, 8, 0, 4, pdl=True).name == "cuda-rt2-w8-sk0-wv4-pdl"
    assert CudaConfig.from_name("cuda-rt2-w8-sk0-wv4-pdl") == CudaConfig(2, 8, 0, 4, pdl=True)
    w4, w8 = random_weight("w4a16-g128", 33, 256, "cpu"), random_weight("w8a16", 33, 256, "cpu")
    assert wc.why_not(w4, torch.bfloat16, 8, cfg) is None
    assert wc.why_not(w4, torch.bfloat16, 16, cfg) is None  # two activation tiles
    assert "M=17" in wc.why_not(w4, torch.bfloat16, 17, cfg)
    assert "at M=9" in wc.why_not(w4, torch.bfloat16, 9, CudaConfig(1, 8, 0, NB=6))  # no MT 2 instance of NB 6
    assert wc.why_not(w4, torch.bfloat16, 17) is None  # the x-staging kernel still takes M 17
    assert "4-bit only" in wc.why_not(w8, torch.bfloat16, 1, cfg)
    assert "no warp-split instance" in wc.why_not(w4, torch.bfloat16, 1, CudaConfig(2, 8, 0, NB=6))
    lb = CudaConfig(2, 8, 0, 4, NB=3, pdl=True, bound=256)
    assert lb.name == "cuda-ws-rt2-w8-nb3-sk0-wv4-lb256-pdl" and CudaConfig.from_name(lb.name) == lb
    assert wc.why_not(w4, torch.bfloat16, 16, lb) is None
    assert "at most 8 warps" in wc.why_not(w4, torch.bfloat16, 1, CudaConfig(1, 16, 0, NB=4, bound=256))
    assert "at most 8 warps" in wc.why_not(w4, torch.bfloat16, 1, CudaConfig(1, 8, 0, NB=4, bound=128))
    assert "option of the warp-split kernel" in wc.why_not(w4, torch.bfloat16, 1, CudaConfig(2, 8, 0, bound=256))
    rt4 = CudaConfig(4, 8, 0, NB=2, bound=256)
    assert wc.why_not(w4, torch.bfloat16, 16, rt4) is None
    assert "no warp-split instance" in wc.why_not(w4, torch.bfloat16, 8, rt4)  # one activation tile: none
    assert "no warp-split instance" in wc.why_not(w4, torch.bfloat16, 16, CudaConfig(4, 8, 0, NB=2))  # bound 512
    d = Dispatch([Cell("w4a16", 1, 16, "cuda", cfg), Cell("w4a16", 1, 16, "triton", GemmConfig())], "test")
    assert d.choose("w4a16", 9, w4, torch.bfloat16).path == ("cuda" if wc.nvcc_missing() is None else "triton")
    d6 = Dispatch([Cell("w4a16", 1, 16, "cuda", CudaConfig(1, 8, 0, NB=6)), Cell("w4a16", 1, 16, "triton", GemmConfig())],
                  "test")
    assert d6.choose("w4a16", 9, w4, torch.bfloat16).path == "triton"  # no instance at M 9: passed over
    if wc.nvcc_missing() is None:
        assert d.choose("w4a16", 8, w4, torch.bfloat16).config == cfg
    gate = random_weight("w4a16-g128", 14336, 4096, "cpu")
    p = wc.plan_warp_split(gate, 1, CudaConfig(1, 8, 0, NB=4), sms=132)
    assert (p.row_blocks, p.splitk, p.chunks_per_split, p.lw) == (896, 1, 32, 4)  # 896 row blocks fill 2 x 132
    down = random_weight("w4a16-g128", 4096, 14336, "cpu")
    p = wc.plan_warp_split(down, 1, CudaConfig(1, 8, 0, NB=4), sms=132)
    assert p.row_blocks == 256 and p.splitk == 1
    kv = random_weight("w4a16-g64-asym", 1024, 4096, "cpu")
    p = wc.plan_warp_split(kv, 1, CudaConfig(1, 8, 0, NB=4), sms=132)
    assert p.lw == 2 and p.row_blocks == 64 and p.splitk == 4 and p.chunks_per_split == 16  # 64 chunks of 64
    p = wc.plan_warp_split(kv, 1, CudaConfig(1, 16, 64, NB=4), sms=132)
    assert p.splitk == 4 and p.chunks_per_split >= 16  # every split keeps at least one chunk per warp
    assert p.smem == 16 * 16 * 8 * 4  # the warps' partials (x is read from L1, not staged)
    assert wc.plan_warp_split(kv, 12, CudaConfig(1, 16, 64, NB=4), sms=132).smem == 2 * p.smem  # 16 activation rows


@gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["w4a16-g128", "w4a16-g64-asym", "w4a16-g32"])
@pytest.mark.parametrize("N,K", [(1001, 1024), (999, 4096), (4096, 14336)])
def test_gpu_warp_split_matches_twin(scheme, N, K):
    """Every (RT, NB, warps, split) instance vs the twin at M 1, 3, 8, and those with two activation tiles at 9,
    13, 16, on odd N (bias on one shape), deterministic across calls."""
    pw = random_weight(scheme, N, K, "cuda", seed=N + K)
    if N == 1001:
        pw.bias = torch.randn(N, device="cuda").bfloat16()
    for M in (1, 3, 8, 9, 13, 16):
        x = torch.randn(M, K, device="cuda").bfloat16()
        ref = wg.linear_twin(x, pw, torch.float32)
        for cfg in (c for c in WS_CONFIGS if wc.why_not(pw, x.dtype, M, c) is None):
            y = wc.linear(x, pw, cfg, torch.float32)
            assert torch.isfinite(y).all(), (scheme, M, cfg)
            assert rel(y, ref) < 1e-4, (scheme, M, cfg.name, rel(y, ref))  # (128 + c) x - (136 + z) sum x in fp32
            assert torch.equal(y, wc.linear(x, pw, cfg, torch.float32)), cfg.name
        yb = wc.linear(x, pw, WS_CONFIGS[1])
        assert yb.dtype == torch.bfloat16 and rel(yb.float(), ref) < 1e-2


@gpu
@needs_cuda
def test_gpu_warp_split_graph_replay_with_split_k():
    pw = random_weight("w4a16-g128", 1024, 4096, "cuda")
    cfg = CudaConfig(1, 8, 4, NB=4)  # split-K across blocks: workspace and counters inside the graph
    _graph_replays_match(torch.randn(1, 4096, device="cuda").bfloat16(), lambda x: wc.linear(x, pw, cfg),
                         lambda x: wg.linear_twin(x, pw, torch.float32), 1e-2)


def test_table_builder_shape_cells_and_dispatch_by_shape(tmp_path):
    """A candidate that wins one shape by more than SHAPE_GAIN gets a cell for that (N, K) ahead of the bucket's;
    the dispatch takes it only for a weight of that shape (and never without a weight)."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bwt", Path(__file__).parents[2] / "benchmarks/build_weight_table.py")
    bwt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bwt)
    ws, xs = "cuda-ws-rt1-w8-nb4-sk0", "cuda-rt2-w8-sk0"
    nk = {"gate/up": (14336, 4096), "down": (4096, 14336), "qkv/o": (4096, 4096), "k/v": (1024, 4096)}
    rows = [{"scheme": "w4a16-g128", "shape": sh, "M": 1, "N": N, "K": K, "bf16_ms": 1.0,
             "candidates": {ws: 0.5 if sh != "k/v" else 0.9, xs: 0.6 if sh != "k/v" else 0.5},
             "rel_l2": {ws: 1e-6, xs: 1e-6}} for sh, (N, K) in nk.items()]
    f = tmp_path / "e.json"
    f.write_text(json.dumps({"env": {"gpu": "X"}, "explore": rows}))
    bwt.main(str(tmp_path / "t.json"), [str(f)])
    cells = [c for c in json.loads((tmp_path / "t.json").read_text())["cells"] if c["m_lo"] == 1]
    assert [(c["config"], c.get("shape")) for c in cells] == [(xs, [1024, 4096]), (ws, None), (xs, None)]
    d = Dispatch([Cell("w4a16", 1, 1, "triton", GemmConfig(BM=16), (1024, 4096)), Cell("w4a16", 1, 1, "triton", GemmConfig())],
                 "test")
    kv, qkv = random_weight("w4a16-g128", 1024, 4096, "cpu"), random_weight("w4a16-g128", 4096, 4096, "cpu")
    assert d.choose("w4a16", 1, kv).shape == (1024, 4096)
    assert d.choose("w4a16", 1, qkv).shape is None and d.choose("w4a16", 1).shape is None
    assert d.table()[0]["shape"] == [1024, 4096] and "shape" not in d.table()[1]


def test_table_builder_takes_audited_bench_rows_on_unexplored_shapes(tmp_path):
    """Bench rows (one timed kernel per cell) count on a shape no exploration timed, only where an audit given
    passed that kernel there, and make a shape cell only where the bucket's pick was timed on the shape too."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bwt", Path(__file__).parents[2] / "benchmarks/build_weight_table.py")
    bwt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bwt)
    pick, old = "cuda-ws-rt4-w4-nb2-sk0-lb256-pdl", "cuda-ws-rt1-w8-nb3-sk0-pdl"
    nk = {"gate/up": (14336, 4096), "down": (4096, 14336), "qkv/o": (4096, 4096)}
    explore = [{"scheme": "w4a16-g128", "shape": sh, "M": 16, "N": N, "K": K, "bf16_ms": 1.0,
                "candidates": {pick: 0.6, old: 0.9}, "rel_l2": {pick: 1e-6, old: 1e-6}} for sh, (N, K) in nk.items()]

    def bench(kernel, ms, shape="smollm2 down", N=576):
        return {"scheme": "w4a16-g128", "shape": shape, "M": 16, "N": N, "K": 1536, "ms": ms, "bf16_ms": 1.0,
                "kernel": f"cuda:{kernel}"}

    def audit(kernel, ok=True, shape="smollm2 down"):
        return {"scheme": "w4a16-g128", "shape": shape, "M": 16, "kernel": f"cuda:{kernel}", "ok": ok}

    files = {"e": {"env": {"gpu": "X"}, "explore": explore},
             "a_old": {"rows": [audit(old), audit(old, shape="smollm2 up")], "dispatch_after_audit": []},
             "b_old": {"rows": [bench(old, 1.0), bench(old, 0.5, "smollm2 up", 1536),
                                bench(old, 0.5, "llama3-8b qkv/o", 4096)]},
             "a_new": {"rows": [audit(pick), audit(pick, False, "smollm2 up")], "dispatch_after_audit": []},
             "b_new": {"rows": [bench(pick, 2.4), bench(pick, 0.1, "smollm2 up", 1536)]}}
    paths = []
    for name, doc in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        paths.append(str(tmp_path / f"{name}.json"))
    bwt.main(str(tmp_path / "t.json"), paths)
    cells = [c for c in json.loads((tmp_path / "t.json").read_text())["cells"] if c["m_lo"] == 9]
    # down: both tables timed, both audited -> the old kernel's cell; up: the pick failed its audit there (not
    # counted) -> no evidence against the pick; llama3-8b qkv/o: explored (4096, 4096), the bench row ignored
    assert [(c["config"], c.get("shape")) for c in cells][:2] == [(old, [576, 1536]), (pick, None)]
    assert cells[0]["bucket_pick_speedup"] == round(1.0 / 2.4, 3) and cells[0]["speedup_vs_bf16"] == 1.0


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [CudaConfig(2, 4, 0, NB=3, pdl=True), CudaConfig(1, 8, 4, NB=4, pdl=True),
                                 CudaConfig(2, 8, 0, pdl=True), CudaConfig(2, 4, 3, pdl=True)])
def test_gpu_pdl_chain_in_a_graph_reads_the_previous_output(cfg):
    """Programmatic dependent launches chained through their data (each linear's input is the previous one's output,
    split-K workspaces and counters in between), captured in one graph: the same as the twin's chain, every replay."""
    pws = [random_weight("w4a16-g128", 1024, 1024, "cuda", seed=i) for i in range(4)]

    def chain(h, fn):
        for pw in pws:
            h = (fn(h, pw) * 4).bfloat16()  # keep the scale of h from shrinking through the chain
        return h

    _graph_replays_match(torch.randn(1, 1024, device="cuda").bfloat16(),
                         lambda x: chain(x, lambda h, pw: wc.linear(h, pw, cfg, torch.float32)),
                         lambda x: chain(x, lambda h, pw: wg.linear_twin(h, pw, torch.float32)), 2e-2)


def _emulate_warp_split(x, pw, lw, nw, n0=0):
    """One block of the warp-split kernel (RT 1, 4-bit, M <= 16: one or two B tiles) in torch, as the .cu writes it: warp w takes chunks
    w, w + nw, ...; each lane's B fragment from its own x words ((k0, k4), (k1, k5) / (k2, k6), (k3, k7)); A holds
    128 + c (no offset); an all-ones A sums x; acc += s * (part - (136 + z) * xsum) per chunk; the warps' partials
    summed in order. -> [M, 16]"""
    M, K = x.shape
    ck, wpc = 32 * lw, 4 * lw
    words = pw.qweight.to(torch.int64) & 0xFFFFFFFF  # [N, K/8]
    rows = [min(n0 + r, pw.N - 1) for r in range(16)]
    mt = 1 if M <= 8 else 2
    xd = torch.zeros(8 * mt, K, dtype=torch.float64)
    xd[:M] = x.double()
    total = torch.zeros(16, 8 * mt, dtype=torch.float64)
    for w in range(nw):
        acc = torch.zeros(16, 8 * mt, dtype=torch.float64)
        for c in range(w, K // ck, nw):
            grp = c * ck // pw.group
            sc = torch.tensor([float(pw.scale[grp, r]) for r in rows], dtype=torch.float64)
            z = torch.tensor([0 if pw.zero is None else int(pw.zero[grp, r]) for r in rows], dtype=torch.float64)
            part = torch.zeros(16, 8 * mt, dtype=torch.float64)
            xsum = torch.zeros(8 * mt, dtype=torch.float64)
            for j in range(lw):
                for hs in range(2):
                    A = torch.zeros(16, 16, dtype=torch.float64)
                    B = torch.zeros(16, 8 * mt, dtype=torch.float64)  # the MT B tiles side by side
                    for lane in range(32):
                        gid, tig = lane >> 2, lane & 3
                        wi = c * wpc + tig * lw + j  # the word this lane loaded (rows gid, gid + 8)
                        for t in range(mt):  # activation row gid + 8 t from this lane's own x loads
                            v = xd[gid + 8 * t, 8 * wi:8 * wi + 8]
                            b = v[[0, 4, 1, 5]] if hs == 0 else v[[2, 6, 3, 7]]
                            col = gid + 8 * t
                            B[2 * tig, col], B[2 * tig + 1, col], B[2 * tig + 8, col], B[2 * tig + 9, col] = b
                        for r in (gid, gid + 8):
                            wd = int(words[rows[r], wi])
                            lo, hi = 8 * hs, 8 * hs + 4  # nib_pair(w >> sh): bits 0-3 and 16-19 of the shifted word
                            A[r, 2 * tig], A[r, 2 * tig + 1] = 128 + ((wd >> lo) & 0xF), 128 + ((wd >> (lo + 16)) & 0xF)
                            A[r, 2 * tig + 8], A[r, 2 * tig + 9] = 128 + ((wd >> hi) & 0xF), 128 + ((wd >> (hi + 16)) & 0xF)
                    part += A @ B
                    xsum += B.sum(0)  # the all-ones mma: every row gets sum_k x
            acc += sc[:, None] * (part - (136.0 + z)[:, None] * xsum[None, :])
        total += acc
    return total[:, :M].t()


@pytest.mark.parametrize("scheme,K,nw", [("w4a16-g128", 512, 2), ("w4a16-g64-asym", 384, 4), ("w4a16-g32", 96, 2)])
def test_warp_split_emulated_matches_twin(scheme, K, nw):
    """The warp-split kernel's index math and offset algebra ((128 + c) x - (136 + z) sum x, chunks interleaved over
    the warps, K chunks not a multiple of the warps) compute the twin's function: the CPU check of the design."""
    pw = random_weight(scheme, 21, K, "cpu", seed=K + nw)
    lw = wc.words_per_lane(4, K, pw.group)
    for M in (5, 13):
        _check_emulated_warp_split(pw, lw, nw, M)


def _check_emulated_warp_split(pw, lw, nw, M):
    x = torch.randn(M, pw.K).bfloat16()
    ref = wg.linear_twin(x, pw, torch.float32).double()
    for n0 in (0, 16):
        y = _emulate_warp_split(x, pw, lw, nw, n0)
        n = min(16, 21 - n0)
        assert rel(y[:, :n], ref[:, n0:n0 + n]) < 1e-6, (lw, M, n0)  # the twin sums in fp32


def test_kernel_input_refuses_before_any_launch():
    """The checks both CUDA weight kernels' linear share (weight_cuda.kernel_input), in their order."""
    pw = random_weight("w4a16-g128", 64, 256, "cpu")
    with pytest.raises(ValueError, match="x has K=128, the weight K=256"):
        wc.kernel_input(torch.zeros(3, 128, dtype=torch.bfloat16), pw, "not reached")
    with pytest.raises(ValueError, match="^no instance here$"):
        wc.kernel_input(torch.zeros(3, 256, dtype=torch.bfloat16), pw, "no instance here")
    with pytest.raises(ValueError, match="one CUDA device"):
        wc.kernel_input(torch.zeros(3, 256, dtype=torch.bfloat16), pw, None)
