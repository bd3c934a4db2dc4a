"""Weight GEMMs (W4A16 / W8A16 / W8A8 / W4A8) against their torch twin, the dispatch table and the audit.

CPU: the Triton interpreter at odd small sizes (M 1, 3, 17; N 33; K 128-256). GPU (marked): the
full audit sweep is `lowbit audit kernels --weights`; here a few LLM cells and a QuantLinear model.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels.gemm import triton_gemm as wg
from lowbit.kernels.gemm.dispatch import Cell, Dispatch, ViaA16, generic_cells
from lowbit.kernels.gemm.prepare import pack_module
from lowbit.kernels.gemm.triton_gemm import GemmConfig, GemvConfig, random_weight
from lowbit.tools.audit.gemm import audit_weights

interp = pytest.mark.skipif(not wg.triton or __import__("os").environ.get("TRITON_INTERPRET") != "1",
                            reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py)")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_int4_pack_round_trip_exhaustive_and_compressed_tensors_order():
    # every code in every nibble position: 16 codes x 8 positions, over several rows
    c = torch.arange(16, dtype=torch.uint8).repeat_interleave(8).reshape(16, 8)
    c = torch.cat([c, c.flip(1), torch.randint(0, 16, (5, 8), dtype=torch.uint8)]).repeat(1, 3)  # [37, 24]
    w = wg.pack_int4_k(c)
    assert w.dtype == torch.int32 and w.shape == (37, 3)
    assert torch.equal(wg.unpack_int4_k(w, 24), c)
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    assert torch.equal(pack_to_int32((c.to(torch.int16) - 8).to(torch.int8), 4), w)  # checkpoint words as they are


@pytest.mark.parametrize("scheme", ["w4a16-g128", "w4a16-g64-asym", "w4a16-g32", "w8a16", "w8a8", "w4a8"])
def test_dequantize_matches_quantlinear(scheme):
    """The packed weight dequantizes to the same numbers as QuantLinear (the one grid)."""
    from lowbit.weights.grid import grid_for_clip, quantize_on
    from lowbit.weights.qlinear import QuantLinear
    from lowbit.weights.scheme import parse_weight_scheme

    sch = parse_weight_scheme(scheme)
    w = torch.randn(33, 256)
    grid = grid_for_clip(w, sch.w_bits, sch.group_for(256), sch.symmetric, 1.0, torch.bfloat16)
    q = QuantLinear.from_codes(quantize_on(w, grid), grid, sch, scale_dtype=torch.bfloat16)
    assert torch.equal(wg.dequantize(pack_module(q)), q.dequantized_weight())
    x = torch.randn(3, 256).bfloat16()
    assert rel(wg.linear_twin(x, pack_module(q), torch.float32), q(x).float()) < 1e-2  # q(x) rounds to bf16


CASES = [  # (scheme, M, N, K, config)
    ("w4a16-g128", 1, 33, 256, GemmConfig(BM=16, BN=16, BK=64)),
    ("w4a16-g128", 17, 33, 256, GemmConfig(BM=16, BN=32, BK=128, unpack="reshape")),
    ("w4a16-g64-asym", 3, 33, 256, GemmConfig(BM=16, BN=16, BK=64, SPLIT_K=2)),
    ("w4a16-g32", 3, 40, 128, GemmConfig(BM=16, BN=32, BK=128)),  # BK shrinks to the group
    ("w4a16-g128", 17, 33, 256, GemmConfig(BM=16, BN=16, BK=128, unpack="split")),
    ("w4a16-g64-asym", 5, 33, 256, GemmConfig(BM=16, BN=16, BK=128, SPLIT_K=2, unpack="split")),
    ("w8a16", 17, 33, 192, GemmConfig(BM=16, BN=16, BK=64)),
    ("w8a8", 3, 33, 128, GemmConfig(BM=16, BN=16, BK=32)),
    ("w8a8", 17, 33, 128, GemmConfig(BM=16, BN=16, BK=32, fused_aq=False)),
    ("w4a8", 1, 33, 256, GemmConfig(BM=16, BN=16, BK=64, SPLIT_K=2)),
    # swapped operands (y^T = W x^T): odd M over two activation row blocks, split-K, zero-points, 8-bit
    ("w4a16-g128", 17, 33, 256, GemmConfig(BM=16, BN=32, BK=128, unpack="reshape", swap=True)),
    ("w4a16-g64-asym", 3, 33, 256, GemmConfig(BM=16, BN=16, BK=64, SPLIT_K=2, swap=True)),
    ("w8a16", 17, 33, 192, GemmConfig(BM=16, BN=16, BK=64, swap=True)),
    ("w8a16", 3, 40, 128, GemmConfig(BM=32, BN=16, BK=32, SPLIT_K=2, swap=True)),
    # W8A8 through TMA descriptors: rows and columns past the tensor's end read as 0 (M 17 over 16-row tiles, N 33)
    ("w8a8", 17, 33, 128, GemmConfig(BM=16, BN=16, BK=32, fused_aq=False, tma=True)),
    ("w8a8", 3, 40, 96, GemmConfig(BM=16, BN=32, BK=32, fused_aq=False, tma=True, GROUP_M=2)),
]


@interp
@pytest.mark.parametrize("scheme,M,N,K,cfg", CASES, ids=[f"{c[0]}-M{c[1]}-{c[4].name}" for c in CASES])
def test_kernel_matches_twin(scheme, M, N, K, cfg):
    pw = random_weight(scheme, N, K, "cpu", seed=M)
    pw.bias = torch.randn(N) if M == 3 else None
    x = torch.randn(M, K).bfloat16()
    y = wg.linear(x, pw, cfg, out_dtype=torch.float32)
    ref = wg.linear_twin(x, pw, out_dtype=torch.float32)
    assert torch.isfinite(y).all()
    assert rel(y, ref) < 1e-5  # integer weights, fp32 accumulation: only the summation order differs
    assert wg.linear(x, pw, cfg).dtype == torch.bfloat16


@interp
def test_swap_refuses_what_it_has_no_kernel_for():
    x = torch.randn(3, 256).bfloat16()
    with pytest.raises(ValueError, match="split unpack has no swapped kernel"):
        wg.linear(x, random_weight("w4a16-g128", 33, 256, "cpu"), GemmConfig(BM=16, BN=16, BK=128, unpack="split", swap=True))
    with pytest.raises(ValueError, match="A16 only"):
        wg.linear(x, random_weight("w8a8", 33, 256, "cpu"), GemmConfig(BM=16, BN=16, BK=64, swap=True))


@interp
def test_tma_config_names_and_refusals():
    cfg = GemmConfig(BM=128, BN=128, BK=128, num_warps=8, fused_aq=False, tma=True)
    assert cfg.name == "bm128-bn128-bk128-sk1-w8-s3-aq2-tma" and GemmConfig.from_name(cfg.name) == cfg
    x = torch.randn(3, 128).bfloat16()
    with pytest.raises(ValueError, match="W8A8 per-channel symmetric weights only"):
        wg.linear(x, random_weight("w8a16", 33, 128, "cpu"), GemmConfig(BM=16, BN=16, BK=32, fused_aq=False, tma=True))
    with pytest.raises(ValueError, match="no split-K"):
        wg.linear(x, random_weight("w8a8", 33, 128, "cpu"), GemmConfig(BM=16, BN=16, BK=32, tma=True))
    # a tabled TMA cell is passed over for a weight it cannot take, to the next cell that covers M
    w8a16 = random_weight("w8a16", 33, 128, "cpu")
    d = Dispatch([Cell("w8a16", 1, 16, "triton", cfg), Cell("w8a16", 1, 16, "triton", GemmConfig())], "test")
    assert d.choose("w8a16", 3, w8a16, torch.bfloat16).config == GemmConfig()
    a8 = Dispatch([Cell("w8a8", 1, 16, "triton", cfg)], "test")
    assert a8.choose("w8a8", 3, random_weight("w8a8", 33, 128, "cpu"), torch.bfloat16).config == cfg


@interp
def test_dequant_cublas_fallback_matches_twin():
    pw = random_weight("w4a16-g64-asym", 33, 128, "cpu")
    x = torch.randn(5, 128).bfloat16()
    assert rel(wg.linear_dequant_cublas(x, pw).float(), wg.linear_twin(x, pw, torch.float32)) < 1e-2
    with pytest.raises(ValueError, match="A16"):
        wg.linear_dequant_cublas(x, random_weight("w8a8", 33, 128, "cpu"))


A16XQ_CASES = [  # (scheme, M, N, K, via): A8 weights through an A16 path with their activation codes
    ("w8a8", 1, 33, 128, ViaA16("triton", GemmConfig(BM=16, BN=16, BK=64))),
    ("w8a8", 17, 40, 192, ViaA16("triton", GemmConfig(BM=16, BN=16, BK=64, SPLIT_K=2))),
    ("w4a8", 3, 33, 256, ViaA16("triton", GemmConfig(BM=16, BN=32, BK=128, unpack="reshape"))),
    ("w4a8-g64", 5, 33, 256, ViaA16("gemv", GemvConfig(BM=8, BN=16, GPT=1, SPLIT_K=2))),
]


@interp
@pytest.mark.parametrize("scheme,M,N,K,via", A16XQ_CASES, ids=[f"{c[0]}-M{c[1]}-{c[4].name}" for c in A16XQ_CASES])
def test_a8_weight_through_an_a16_path_matches_twin(scheme, M, N, K, via):
    """s_x * (x_q @ W^T) + bias == the twin's (x_q * s_x) @ W^T + bias: the same codes, only the order differs;
    with the bias, the scale must not reach it."""
    from lowbit.kernels.gemm.dispatch import linear_via_a16, run_cell

    pw = random_weight(scheme, N, K, "cpu", seed=M)
    pw.bias = torch.randn(N) * 3
    x = (torch.randn(M, K) * torch.logspace(-2, 1, M).unsqueeze(1)).bfloat16()  # per-token scales differ
    ref = wg.linear_twin(x, pw, out_dtype=torch.float32)
    y = linear_via_a16(x, pw, via, torch.float32)
    assert torch.isfinite(y).all() and rel(y, ref) < 1e-5
    cell = Cell(pw.kind, 1, 64, "a16-xq", via)
    assert cell.kernel == f"a16-xq:{via.name}" and torch.equal(run_cell(cell, x, pw, torch.float32), y)
    assert linear_via_a16(x, pw, via).dtype == torch.bfloat16
    assert pw.a_bits == 8 and pw.bias is not None  # the weight itself is left as it was
    q8, s8 = wg.quantize_rows(x)
    qb, sb = wg.quantize_rows(x, torch.bfloat16)  # the codes a16-xq feeds the A16 kernel
    assert qb.dtype == torch.bfloat16 and torch.equal(q8.to(torch.bfloat16), qb) and torch.equal(s8, sb)
    with pytest.raises(ValueError, match="int8 or bf16"):
        wg.quantize_rows(x, torch.float16)
    with pytest.raises(ValueError, match="A8 weights"):
        linear_via_a16(x, random_weight("w8a16", N, K, "cpu"), via)


def test_a16xq_names_round_trip_through_the_table():
    from lowbit.kernels.gemm.cuda_gemm import CudaConfig
    from lowbit.kernels.gemm.dispatch import config_from_name

    for via in (ViaA16("cuda", CudaConfig(2, 8, 0)), ViaA16("triton", GemmConfig(BM=16, BN=32, BK=128)),
                ViaA16("dequant-cublas")):
        assert config_from_name("a16-xq", via.name) == via
    with pytest.raises(ValueError, match="not an A16 path"):
        ViaA16.from_name("a16-xq:triton:bm16")


def test_dispatch_first_cell_that_covers_and_errors_name_what_exists():
    d = Dispatch(generic_cells(), "generic")
    assert d.choose("w4a16", 1).path == "triton" and d.choose("w4a16", 10**6).path == "dequant-cublas"
    gone = d.without([("w4a16", 1, d.choose("w4a16", 1).kernel)])
    assert gone.choose("w4a16", 1).path == "dequant-cublas"  # the last resort, not the removed cell
    assert gone.choose("w4a16", 64).path == "triton"  # other M ranges keep their kernel
    assert "removed by the audit" in gone.source
    a8_gone = d.without([("w8a8", 1, d.choose("w8a8", 1).kernel)])
    assert a8_gone.choose("w8a8", 1).kernel == "a16-xq:dequant-cublas"  # A8's last resort
    a8 = Dispatch([c for c in generic_cells() if c.kind == "w8a8"], "only w8a8")
    with pytest.raises(LowbitError, match="no weight kernel for w4a16 at M=3.*w8a8"):
        a8.choose("w4a16", 3)


@interp
def test_audit_removes_a_cell_whose_kernel_returns_nan(monkeypatch):
    real = wg.linear

    def broken(x, pw, config=None, out_dtype=None):
        y = real(x, pw, config, out_dtype)
        return torch.full_like(y, float("nan")) if x.shape[0] == 17 and pw.kind == "w8a16" else y

    monkeypatch.setattr(wg, "linear", broken)
    cells = [Cell("w8a16", 1, 16, "triton", GemmConfig(BM=16, BN=16, BK=64)),
             Cell("w8a16", 17, 64, "triton", GemmConfig(BM=16, BN=16, BK=64))]
    lines = []
    rows, d = audit_weights("cpu", schemes=("w8a16",), shapes=[("tiny", 128, 33)], ms=(1, 17),
                            dispatch=Dispatch(cells, "test"), log=lines.append)
    bad = [r for r in rows if not r.ok]
    assert [(r.M, r.finite) for r in bad] == [(17, False)]
    assert "M=17 N=33 K=128" in lines[0]  # the failure names the shape
    assert d.choose("w8a16", 1).config == cells[0].config
    with pytest.raises(LowbitError, match="no weight kernel for w8a16 at M=17"):
        d.choose("w8a16", 17)


def test_prepare_cuda_refuses_cpu_models():
    from lowbit.kernels.gemm.prepare import prepare_cuda
    from lowbit.weights.qlinear import QuantLinear
    from lowbit.weights.scheme import parse_weight_scheme

    m = torch.nn.Sequential(QuantLinear(128, 16, parse_weight_scheme("w8a16")))
    with pytest.raises(LowbitError, match="CUDA"):
        prepare_cuda(m)
    with pytest.raises(LowbitError, match="no QuantLinear"):
        prepare_cuda(torch.nn.Sequential(torch.nn.Linear(4, 4)))


gpu = pytest.mark.gpu


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["w4a16-g128", "w4a16-g64-asym", "w8a16", "w8a8", "w4a8"])
def test_gpu_cells_match_twin(scheme):
    rows, _ = audit_weights("cuda", schemes=(scheme,), shapes=[("odd", 4096, 1001), ("llama down", 14336, 4096)],
                            ms=(1, 3, 17, 99, 999))
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 3, 17, 99, 999])
def test_gpu_w8a8_tma_configs_match_twin(M):
    pw = random_weight("w8a8", 1001, 4096, "cuda", seed=M)
    pw.bias = torch.randn(1001, device="cuda").bfloat16() if M == 17 else None
    x = torch.randn(M, 4096, device="cuda").bfloat16()
    ref = wg.linear_twin(x, pw, out_dtype=torch.float32)
    for cfg in (GemmConfig(BM=128, BN=128, BK=128, num_warps=8, fused_aq=False, tma=True),
                GemmConfig(BM=128, BN=256, BK=128, num_warps=8, num_stages=4, fused_aq=False, tma=True),
                GemmConfig(BM=64, BN=128, BK=128, num_warps=4, num_stages=4, fused_aq=False, tma=True)):
        y = wg.linear(x, pw, cfg, out_dtype=torch.float32)
        assert torch.isfinite(y).all() and rel(y, ref) < 1e-3, (cfg.name, rel(y, ref))


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["w4a16-g128", "w4a16-g64-asym", "w8a16"])
@pytest.mark.parametrize("M", [1, 3, 17, 99])
def test_gpu_swapped_operand_configs_match_twin(scheme, M):
    pw = random_weight(scheme, 1001, 4096, "cuda", seed=M)
    x = torch.randn(M, 4096, device="cuda").bfloat16()
    ref = wg.linear_twin(x, pw, out_dtype=torch.float32)
    for cfg in (GemmConfig(BM=16, BN=64, BK=128, unpack="pairs", swap=True),
                GemmConfig(BM=64, BN=128, BK=64, SPLIT_K=4, num_warps=8, unpack="pairs", swap=True),
                GemmConfig(BM=32, BN=64, BK=128, unpack="reshape", swap=True)):
        y = wg.linear(x, pw, cfg, out_dtype=torch.float32)
        assert torch.isfinite(y).all() and rel(y, ref) < 1e-3, cfg.name


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_quantlinear_model_packed_and_equal_to_torch_forward():
    from lowbit.kernels.gemm.prepare import prepare_cuda
    from lowbit.weights.grid import grid_for_clip, quantize_on
    from lowbit.weights.qlinear import QuantLinear
    from lowbit.weights.scheme import parse_weight_scheme

    sch = parse_weight_scheme("w4a16-g128")
    w = torch.randn(1000, 512)
    grid = grid_for_clip(w, 4, 128, True, 1.0, torch.bfloat16)
    q = QuantLinear.from_codes(quantize_on(w, grid), grid, sch, scale_dtype=torch.bfloat16)
    x = torch.randn(2, 7, 512).bfloat16()
    ref = q(x).float()
    model = torch.nn.Sequential(q).cuda()
    rep = prepare_cuda(model)
    assert rep["packed_bytes"] < rep["bf16_bytes"] / 3.5 and not rep["removed"]
    assert rel(model(x.cuda()).float().cpu(), ref) < 1e-2


GEMV_CASES = [  # (scheme, M, N, K, config)
    ("w4a16-g128", 1, 33, 256, wg.GemvConfig(BM=1, BN=16)),
    ("w4a16-g64-asym", 3, 40, 256, wg.GemvConfig(BM=4, BN=16, GPT=2, SPLIT_K=2)),
    ("w4a16-g32", 2, 17, 128, wg.GemvConfig(BM=2, BN=16, GPT=2)),
    ("w8a16", 4, 33, 192, wg.GemvConfig(BM=4, BN=16, SPLIT_K=3)),  # per-channel, K not a power of two
    ("w8a16", 1, 5, 1024, wg.GemvConfig(BM=1, BN=2, GPT=4)),  # per-channel, the whole K in one tile
    ("w8a16", 2, 9, 768, wg.GemvConfig(BM=2, BN=4, GPT=4)),  # per-channel, GPT shrunk to divide K / 256
]


@interp
@pytest.mark.parametrize("scheme,M,N,K,cfg", GEMV_CASES, ids=[f"{c[0]}-M{c[1]}-{c[4].name}" for c in GEMV_CASES])
def test_gemv_matches_twin(scheme, M, N, K, cfg):
    pw = random_weight(scheme, N, K, "cpu", seed=M)
    pw.bias = torch.randn(N)
    x = torch.randn(M, K).bfloat16()
    assert rel(wg.gemv(x, pw, cfg, torch.float32), wg.linear_twin(x, pw, torch.float32)) < 1e-5
    with pytest.raises(ValueError, match="M <="):
        wg.gemv(torch.randn(cfg.BM + 1, K).bfloat16(), pw, cfg)


def _a8_rows(M, K, dtype, seed):
    """x [M, K]: random rows of mixed magnitude, an all-zero row, a row of exact ties (x / s = k + 1/2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g).mul(6).exp2()
    if M > 1:
        x[1] = 0
    if M > 2:
        r = torch.randint(-128, 127, (K,), generator=g).float() + 0.5
        r[0], r[1] = -127.5, 127.5
        x[2] = r / 8  # amax 15.9375: s = 1/8 exactly
    return x.to(dtype)


def _check_a8_codes(M, K, dtype, device, cfgs, w4_group=16):
    """The A8 kernels' activation codes and scales == lowbit.weights.act_quant's, read through an identity
    weight with scale 1 (y = x_q * s_x holds in fp32 with no rounding at all)."""
    from lowbit.weights.act_quant import quantize_activations_per_token

    x = _a8_rows(M, K, dtype, seed=M).to(device)
    q, s = quantize_activations_per_token(x)
    qk, sk = wg.quantize_rows(x)
    assert torch.equal(qk, q) and torch.equal(sk, s[:, 0])
    for bits, group in ((8, K), (4, w4_group)):  # W8A8 per channel, W4A8 groups
        codes = torch.full((K, K), 1 << (bits - 1), dtype=torch.uint8) + torch.eye(K, dtype=torch.uint8)  # q = I
        pw = wg.pack_weight(codes.to(device), torch.ones(K, K // group, device=device), None, bits=bits,
                            group=group, a_bits=8)
        for cfg in cfgs:
            y = wg.linear(x, pw, cfg, out_dtype=torch.float32)
            assert torch.equal(y, q.float() * s), (bits, cfg.name)


@interp
@pytest.mark.parametrize("K", [112, 4096, 8208])
def test_row_quantizer_rows_of_one_and_many_tiles(K):
    """quantize_rows over a row shorter than its 1024-wide tile, a few tiles, and a ragged last tile: the one
    quantizer's codes and scales."""
    from lowbit.weights.act_quant import quantize_activations_per_token

    x = _a8_rows(3, K, torch.bfloat16, seed=K)
    q, s = quantize_activations_per_token(x)
    qk, sk = wg.quantize_rows(x)
    assert torch.equal(qk, q) and torch.equal(sk, s[:, 0])


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("M", [1, 3, 17])
def test_a8_activation_codes_and_scales_are_the_one_quantizers(M, dtype):
    """Fused prologue and separate row kernel both give exactly the one quantizer's codes and scales
    (compressed-tensors' arithmetic: tests/weights/test_act_quant.py). K = 112 is a multiple of 16 but not a
    power of two, and N = K is not a multiple of BN."""
    _check_a8_codes(M, 112, dtype, "cpu", [GemmConfig(BM=16, BN=32, BK=16), GemmConfig(BM=16, BN=32, BK=16, fused_aq=False)])


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or wg.triton is None
                    or __import__("os").environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA, TRITON_INTERPRET=0")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("M", [1, 17, 999])
def test_gpu_a8_activation_codes_and_scales_are_the_one_quantizers(M, dtype):
    """The same on the GPU, compiled: div_rn and the bf16/fp16 rounding against torch's CUDA arithmetic
    (what compressed-tensors runs there), through the generic A8 cells' tilings."""
    from lowbit.kernels.gemm.dispatch import generic_cells

    cfgs = {c.config for c in generic_cells() if c.kind in ("w8a8", "w4a8") and c.path == "triton"}
    cfgs |= {GemmConfig(BM=16, BN=32, BK=32, fused_aq=False)}  # Triton's int8 dot on CUDA takes K tiles >= 32
    _check_a8_codes(M, 1056, dtype, "cuda", sorted(cfgs, key=lambda c: c.name), w4_group=32)  # 1056 = 32 * 33


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or wg.triton is None
                    or __import__("os").environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA, TRITON_INTERPRET=0")
def test_gpu_a8_k_tile_under_32_is_a_clear_error():
    pw = random_weight("w4a8-g16", 64, 112, "cuda")  # groups of 16: no K tile of 32 fits one
    with pytest.raises(ValueError, match="K tile of at least 32"):
        wg.linear(torch.randn(3, 112, device="cuda").bfloat16(), pw, GemmConfig(BM=16, BN=32, BK=64))


@interp
def test_round_act_is_torchs_fp32_to_bf16_and_fp16_rounding():
    """_round_act (the A8 step's fp32 -> activation-dtype rounding) == torch's cast, on random fp32 bit patterns
    of every magnitude (subnormals, near-overflow) and on exact bf16 midpoints (ties go to even)."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(x_ptr, y_ptr, n, ADT: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + r, wg._round_act(tl.load(x_ptr + r, mask=r < n), ADT), mask=r < n)

    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2**31, 2**31 - 1, (1 << 15,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    mids = (torch.randn(1 << 12, generator=g).bfloat16().float().view(torch.int32) | 0x8000).view(torch.float32)
    x = torch.cat([x[torch.isfinite(x)], mids, torch.tensor([65519.0, 65520.0, 3.3895e38, -3.3895e38])])
    for adt, dtype in ((1, torch.bfloat16), (2, torch.float16)):
        y = torch.empty_like(x)
        k[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), ADT=adt, BLOCK=4096)
        assert torch.equal(y, x.to(dtype).float()), dtype


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_gpu_a16xq_is_capturable_and_matches_twin(scheme):
    """The a16-xq path through the CUDA small-M kernel (where it takes the weight) inside a CUDA graph."""
    from lowbit.kernels.gemm.cuda_gemm import CudaConfig
    from lowbit.kernels.gemm.dispatch import linear_via_a16

    pw = random_weight(scheme, 4096, 1024, "cuda", seed=3)
    pw.bias = torch.randn(4096, device="cuda")
    via = ViaA16("cuda", CudaConfig(2, 8, 0))
    x = torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16)
    ref = wg.linear_twin(x, pw, torch.float32)
    y = linear_via_a16(x, pw, via, torch.float32)
    assert rel(y, ref) < 1e-4
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = linear_via_a16(x, pw, via, torch.float32)
    x.copy_(torch.randn_like(x) * 4)
    g.replay()
    assert rel(yg, wg.linear_twin(x, pw, torch.float32)) < 1e-4


def test_committed_h200_table_parses_and_covers_every_kind_and_m():
    from lowbit.kernels.gemm.dispatch import KINDS, M_INF, measured_cells

    cells, source = measured_cells((9, 0))
    assert "sm90.json" in source
    d = Dispatch(cells, source)
    for kind in KINDS:
        for M in (1, 2, 5, 17, 33, 65, 257, 1025, M_INF):
            c = d.choose(kind, M)
            assert c.path != "a16-xq" or (kind.endswith("a8") and isinstance(c.config, ViaA16))
