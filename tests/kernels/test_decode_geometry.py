"""The geometry decode kernel (lowbit.kernels.attention.geometry) vs its torch twins, and its use by the cache.

CPU: the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), small odd shapes (B 1/3,
lengths 1, 17, 99, odd tier lengths). GPU (marked): the full-size geometries (DeepSeek-V3 latent with
128 heads, Kimi-K2 K192/V128 with 64 heads, Gemma-4 full 512 with K = V).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _make import make_inputs, packed_tier, rel_l2

from lowbit.core.errors import LowbitError
from lowbit.kernels.attention.common import interpreted
from lowbit.kernels.attention.geometry import GeoConfig, decode_attention_geo, decode_attention_latent
from lowbit.kernels.attention.reference import decode_attention_latent_ref, decode_attention_ref
from lowbit.kernels.attention.tiers import decode_attention

TOL = 1e-3
cpu_only = pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available() or interpreted(), reason="needs CUDA, TRITON_INTERPRET=0")
SMALL = GeoConfig(block_t=16, num_splits=3, dense_block=16)


def _poisoned(q, Dv, device):
    return torch.full((q.shape[0], q.shape[1], Dv), float("nan"), dtype=torch.float32, device=device)


def _check(out, ref):
    assert torch.isfinite(out).all(), "kernel wrote NaN/Inf or left outputs unwritten"
    err = rel_l2(out, ref)
    assert err <= TOL, f"rel L2 error {err:.2e} > {TOL}"
    return err


def latent_inputs(B, Hq, Hkv, D, DR, T, *, bits=2, group=128, sink=0, recent=0, mid_lens=None, sink_lens=None,
                  recent_lens=None, dtype=torch.bfloat16, device="cpu", seed=0, dense_mid=False):
    """Keyword dict for decode_attention_latent / its twin: a latent x (with per-channel offsets) packed
    through lowbit.quant, its dense key part pe, and dense tiers."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    x = rnd(B, Hkv, T, D) + 1.5 * rnd(1, Hkv, 1, D)
    kw = {"q_lat": rnd(B, Hq, D).to(dtype).to(device), "q_pe": rnd(B, Hq, DR).to(dtype).to(device) if DR else None,
          "bits": bits}
    if T:
        if dense_mid:
            kw.update(codes=x.to(dtype).to(device), scale=None, zero=None, dense_mid=True)
        else:
            c, s, z = packed_tier(x, bits, group)
            kw.update(codes=c.to(device), scale=s.to(device), zero=z.to(device))
        kw["pe"] = rnd(B, Hkv, T, DR).to(dtype).to(device) if DR else None
        if mid_lens is not None:
            kw["mid_lens"] = torch.tensor(mid_lens, dtype=torch.int32).to(device)
    else:
        kw.update(codes=None, scale=None, zero=None, pe=None)
    for name, n, lens in (("sink", sink, sink_lens), ("recent", recent, recent_lens)):
        if n:
            kw[f"{name}_v"] = rnd(B, Hkv, n, D).to(dtype).to(device)
            kw[f"{name}_pe"] = rnd(B, Hkv, n, DR).to(dtype).to(device) if DR else None
            if lens is not None:
                kw[f"{name}_lens"] = torch.tensor(lens, dtype=torch.int32).to(device)
    return kw


def _run_latent(kw, cfg=SMALL, device="cpu"):
    out = _poisoned(kw["q_lat"], kw["q_lat"].shape[-1], device)
    decode_attention_latent(**kw, config=cfg, out=out)
    return out, decode_attention_latent_ref(**kw)


def _run_geo(kw, cfg=SMALL, device="cpu"):
    Dv = kw["v_codes"].shape[3] * 8 // kw["v_bits"] if kw.get("v_codes") is not None else kw["recent_v"].shape[3]
    out = _poisoned(kw["q"], Dv, device)
    decode_attention_geo(**kw, config=cfg, out=out)
    return out, decode_attention_ref(**kw)


# ------------------------------------------------------------------ separate K / V (K192/V128, 512)
GEO_CASES = [
    # (B, Hq, Hkv, Dk, Dv, T, kbits, vbits, group, sink, recent, mid_lens)
    (1, 2, 2, 192, 128, 1, 2, 2, 64, 0, 3, None),  # length 1, MHA (G = 1)
    (3, 2, 2, 192, 128, 17, 2, 2, 64, 3, 5, [17, 1, 9]),  # Kimi's strided 192 (S = 48: 12 chunks of 16)
    (3, 3, 1, 192, 128, 99, 4, 4, 64, 0, 7, [99, 0, 50]),  # 4-bit (S = 96), GQA 3, an empty sequence
    (2, 2, 1, 192, 128, 17, 8, 2, 64, 1, 0, None),  # k8v2
    (1, 3, 1, 512, 512, 19, 2, 2, 128, 2, 3, None),  # head_dim 512 GQA
    (3, 2, 1, 512, 512, 17, 4, 4, 128, 0, 5, [17, 3, 16]),
]


@cpu_only
@pytest.mark.parametrize("case", GEO_CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-K{c[3]}V{c[4]}-T{c[5]}-k{c[6]}v{c[7]}")
def test_geo_matches_twin_interpreter(case):
    B, Hq, Hkv, Dk, Dv, T, kb, vb, grp, sink, rec, lens = case
    kw = make_inputs(B, Hq, Hkv, Dk, T, kbits=kb, vbits=vb, group=grp, Dv=Dv, sink=sink, recent=rec,
                     mid_lens=lens, dtype=torch.bfloat16, seed=T + Dk)
    _check(*_run_geo(kw))


@cpu_only
def test_decode_attention_hands_other_head_dims_to_the_geometry_kernel():
    kw = make_inputs(1, 2, 1, 192, 17, kbits=2, vbits=2, group=64, Dv=128, recent=3, dtype=torch.bfloat16, seed=2)
    out, launch = decode_attention(**kw, out=_poisoned(kw["q"], 128, "cpu"), return_launch=True)
    assert type(launch).__name__ == "GeoLaunch"
    _check(out, decode_attention_ref(**kw))


# ------------------------------------------------------------------ shared K/V (MLA latent, Gemma-4 K = V)
LATENT_CASES = [
    # (B, Hq, Hkv, D, DR, T, bits, group, sink, recent, mid_lens, sink_lens, recent_lens)
    (1, 3, 1, 512, 64, 1, 2, 128, 0, 3, None, None, None),  # MLA latent, length 1
    (3, 5, 1, 512, 64, 17, 2, 128, 2, 5, [17, 1, 9], None, [5, 0, 3]),  # ragged, an empty recent tier
    (3, 4, 1, 512, 64, 99, 4, 128, 3, 1, [99, 0, 40], [3, 1, 0], None),  # 4-bit, an empty middle
    (1, 16, 1, 512, 128, 33, 2, 128, 1, 7, None, None, None),  # Gemma-4 full: K's 128 RoPE dims dense
    (2, 3, 1, 128, 0, 17, 8, 64, 0, 5, None, None, None),  # no dense key part, 8-bit, two groups
]


@cpu_only
@pytest.mark.parametrize("case", LATENT_CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-D{c[3]}+{c[4]}-T{c[5]}-int{c[6]}")
def test_latent_matches_twin_interpreter(case):
    B, Hq, Hkv, D, DR, T, bits, grp, sink, rec, ml, sl, rl = case
    kw = latent_inputs(B, Hq, Hkv, D, DR, T, bits=bits, group=grp, sink=sink, recent=rec, mid_lens=ml,
                       sink_lens=sl, recent_lens=rl, seed=T + Hq)
    _check(*_run_latent(kw))


@cpu_only
def test_latent_head_blocks_cover_every_head():
    # 37 heads in blocks of 16 (3 programs per tile, the last one partial): every head written and right
    kw = latent_inputs(1, 37, 1, 512, 64, 17, sink=1, recent=2, seed=9)
    out, ref = _run_latent(kw, GeoConfig(block_t=16, heads=16, num_splits=2, dense_block=16))
    _check(out, ref)


@cpu_only
def test_latent_dense_middle_baseline_is_the_same_attention():
    kw = latent_inputs(3, 5, 1, 512, 64, 17, recent=3, mid_lens=[17, 4, 0], dense_mid=True, seed=4)
    _check(*_run_latent(kw))


@cpu_only
def test_latent_two_kv_heads_read_their_own_latent():
    kw = latent_inputs(1, 6, 2, 128, 16, 17, group=64, recent=2, seed=6)
    kw["zero"][:, 1] += 5.0  # KV head 1's latent shifted: heads 3-5 see it (in V, and in the score)
    out, ref = _run_latent(kw)
    _check(out, ref)
    assert (out[0, 3:] - out[0, :3]).abs().mean() > 1.0


@cpu_only
@pytest.mark.parametrize("mutate, match", [
    (lambda kw: kw.update(pe=None), "no middle pe"),
    (lambda kw: kw.update(q_pe=kw["q_pe"][..., :48].contiguous()), "power of two"),
    (lambda kw: kw.update(scale=kw["scale"].float()), "float16"),
    (lambda kw: kw.update(codes=kw["codes"][:, :, ::2]), "back to back"),
    (lambda kw: kw.update(recent_pe=None), "pe with its V"),
])
def test_latent_bad_input_raises(mutate, match):
    kw = latent_inputs(1, 2, 1, 512, 64, 8, recent=2, seed=8)
    mutate(kw)
    with pytest.raises(LowbitError, match=match):
        decode_attention_latent(**kw, config=SMALL)


@cpu_only
def test_geo_bad_tiling_raises():
    kw = make_inputs(1, 2, 1, 192, 8, kbits=2, group=8, Dv=128, dtype=torch.bfloat16, seed=9)
    with pytest.raises(LowbitError, match="group"):
        decode_attention_geo(**kw, config=SMALL)
    kw = make_inputs(1, 2, 1, 192, 8, kbits=2, group=16, Dv=96, dtype=torch.bfloat16, seed=9)
    with pytest.raises(LowbitError, match="power"):
        decode_attention_geo(**kw, config=SMALL)


# ------------------------------------------------------------------ the plan and the cache
def _plan(family, mla=None, scheme="int2", device="cuda"):
    from lowbit.kv.plan import resolve
    from lowbit.models.families import family_geometry

    geo = family_geometry(family, mla=mla or "latent")
    return resolve(scheme, geo, device=device)


@pytest.mark.parametrize("family, mla", [("deepseek-v3", "latent"), ("kimi-k2", "expanded"), ("gemma4-text", None)])
def test_plan_puts_the_new_geometries_on_the_kernel(family, mla):
    plan = _plan(family, mla)
    for lp in plan.layers:
        choice = lp.backends["decode"]
        assert choice.name == "triton-decode", (lp.geometry, choice.reason)


def test_plan_names_why_not():
    from lowbit.kv.capabilities import geo_tiling_reason, shared_reason
    from lowbit.kv.plan import resolve
    from lowbit.models.families import family_geometry

    assert "chunks of" in geo_tiling_reason(2, 192, 8) or "register chunks" in geo_tiling_reason(2, 192, 8)
    assert "power of two" in geo_tiling_reason(2, 192, 64, value=True)
    assert geo_tiling_reason(2, 192, 64) is None and geo_tiling_reason(2, 512, 128, value=True) is None
    plan = resolve("int2", family_geometry("deepseek-v3", mla="latent"), device="cuda")
    assert shared_reason(plan.layers[0]) is None
    bf = resolve("bf16", family_geometry("deepseek-v3", mla="latent"), device="cuda")
    assert bf.layers[0].backends["decode"].name == "torch-stream"


def _tiny_run(name, mla, scheme_name, backend, steps=3, **model_kw):
    from lowbit.models.geometry import ModelGeometry
    from lowbit.models.tiny import tiny_tokenizer_free_inputs
    from lowbit.runtime.cache import QuantizedKVCache

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kv"))
    from helpers import make_model, run_chunks, scheme

    model = make_model(name, **model_kw)
    geo = ModelGeometry.from_config(model.config, mla=mla) if mla else None
    chunks = [19] + [1] * steps
    ids = tiny_tokenizer_free_inputs(model.config, 3, sum(chunks), seed=5)
    cache = QuantizedKVCache(model, scheme(scheme_name), geometry=geo, decode_backend=backend)
    return run_chunks(model, cache, ids, None, chunks), cache


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("name, mla, scheme_name, kw", [
    ("deepseek-v3", "latent", "int2", {"first_k_dense_replace": 2}),
    ("deepseek-v3", "expanded", "int4", {"first_k_dense_replace": 2}),
    ("gemma4-text", None, "int2", {"num_layers": 2, "sliding_window": 11}),
], ids=["mla-latent-int2", "k192v128-int4", "gemma4-kv-int2"])
def test_cache_decode_on_the_kernel_equals_the_torch_path(name, mla, scheme_name, kw):
    """The cache's decode steps through the kernel (interpreter) give the torch path's logits."""
    ref, _ = _tiny_run(name, mla, scheme_name, "torch", **kw)
    out, cache = _tiny_run(name, mla, scheme_name, "triton", **kw)
    assert cache.backend_calls["triton"] > 0
    assert any(lp.geometry.shares_kv or lp.geometry.head_dim_k not in (64, 128, 256)
               for lp in cache.plan.layers if lp.backends["decode"].name == "triton-decode")
    dec = slice(19, None)  # the decode steps (the prefill is the torch path in both)
    err = float((out[:, dec] - ref[:, dec]).norm() / ref[:, dec].norm())
    assert err < 2e-3, err


# ------------------------------------------------------------------------------------------ GPU
GPU_LATENT = [
    # (B, Hq, D, DR, T, bits, lens, dense_mid)  DeepSeek-V3 (128 heads, rank 512 + rope 64), Gemma-4 full (16 x 512 + 128)
    (3, 128, 512, 64, 4000, 2, "ragged", False),
    (1, 128, 512, 64, 32768, 4, None, False),
    (16, 16, 512, 64, 2000, 2, None, False),
    (5, 16, 512, 128, 3000, 2, "ragged", False),
    (2, 16, 512, 128, 999, 4, None, False),
    (3, 128, 512, 64, 4000, 16, "ragged", True),  # the bf16 dense-latent baseline
]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("case", GPU_LATENT, ids=lambda c: f"B{c[0]}-Hq{c[1]}-D{c[2]}+{c[3]}-T{c[4]}-int{c[5]}"
                         + ("-bf16" if c[-1] else ""))
def test_latent_matches_twin_gpu(case):
    B, Hq, D, DR, T, bits, lens, dense_mid = case
    g = torch.Generator().manual_seed(T)
    ml = torch.randint(0, T + 1, (B,), generator=g).tolist() if lens == "ragged" else None
    kw = latent_inputs(B, Hq, 1, D, DR, T, bits=bits, sink=64, recent=256, mid_lens=ml, device="cuda", seed=T,
                       dense_mid=dense_mid)
    _check(*_run_latent(kw, GeoConfig(), device="cuda"))


GPU_GEO = [
    # (B, Hq, Hkv, Dk, Dv, T, kbits, vbits, group, lens)
    (2, 64, 64, 192, 128, 3000, 2, 2, 64, "ragged"),  # Kimi-K2 expanded
    (1, 64, 64, 192, 128, 8192, 4, 4, 64, None),
    (3, 16, 1, 512, 512, 5000, 2, 2, 128, "ragged"),  # head_dim 512 GQA
    (17, 9, 3, 192, 128, 129, 2, 4, 64, "ragged"),
]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("case", GPU_GEO, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-K{c[3]}V{c[4]}-T{c[5]}-k{c[6]}v{c[7]}")
def test_geo_matches_twin_gpu(case):
    B, Hq, Hkv, Dk, Dv, T, kb, vb, grp, lens = case
    g = torch.Generator().manual_seed(T)
    ml = torch.randint(0, T + 1, (B,), generator=g).tolist() if lens == "ragged" else None
    kw = make_inputs(B, Hq, Hkv, Dk, T, kbits=kb, vbits=vb, group=grp, Dv=Dv, sink=64, recent=256, mid_lens=ml,
                     dtype=torch.bfloat16, device="cuda", seed=T)
    _check(*_run_geo(kw, GeoConfig(), device="cuda"))



@pytest.mark.slow
@cpu_only
def test_geo_bench_rows_run_end_to_end_on_cpu():
    """The bench's row logic (baselines, candidates, bytes, ratios) on CPU tensors with a stand-in timer."""
    from lowbit.tools.bench import geometry as geo_bench

    calls = []

    def timer(fns):
        fns[0]()
        calls.append(1)
        return 1.0 + 0.1 * len(calls)

    res = geo_bench.run(batches=(1,), lengths=(40,), geometries=("deepseek-v3-latent-tp8", "gemma4-full512", "kimi-k192v128"),
                        bits=(2,), log=lambda *_: None, dev="cpu", timer=timer)
    lat, gem, kimi = res["rows"]
    assert lat["baseline"].startswith("lowbit latent kernel") and lat["baseline_ms"] < lat["torch_latent_ms"]
    assert "sdpa_ms" not in lat and lat["k2v2_ratio"] == lat["baseline_ms"] / lat["k2v2_ms"]
    assert lat["bf16_bytes_per_token_layer"] == 1152 and lat["k2v2_bytes_per_token_layer"] == 128 + 16 + 128
    assert gem["k2v2_bytes_per_token_layer"] == 128 + 16 + 256 and gem["bf16_bytes_per_token_layer"] == 2048
    assert kimi["k2v2_bytes_per_token_layer"] == 64 * (48 + 12 + 32 + 4) and "sdpa_ms" in kimi
    want = {str(c) for c in geo_bench.candidates(geo_bench.GEOMETRIES["kimi-k192v128"])}
    assert set(kimi["k2v2_candidates_ms"]) == want and len(want) == 3 and kimi["k2v2_config"]["num_splits"] >= 1


def test_geo_bench_parse_config_reads_fields_and_names_bad_ones():
    from lowbit.kernels.attention.geometry import GeoConfig
    from lowbit.tools.bench import geometry as geo_bench

    assert geo_bench.parse_config("block_t=64,heads=8,q_loop=0") == GeoConfig(block_t=64, heads=8, q_loop=False)
    for bad in ("block=64", "heads=eight", "heads"):
        with pytest.raises(LowbitError, match="GeoConfig fields"):
            geo_bench.parse_config(bad)


def test_latent_launch_follows_the_batch():
    """The MLA latent's launch fields at few (sequence, KV head) pairs (few_pairs, from the H200 sweep by batch);
    fields the caller set win; other geometries and larger batches keep the shape defaults."""
    from lowbit.kernels.attention.geometry import GeoConfig

    base = GeoConfig()
    tp8, full = (16, 512, 576, True), (128, 512, 576, True)
    d16 = base.resolve(*tp8)
    assert base.resolve(*tp8, pairs=16) == d16 and base.resolve(*tp8, pairs=4) == d16
    b1 = base.resolve(*tp8, pairs=1)
    assert (b1.heads, b1.block_t, b1.num_warps, b1.q_loop) == (8, 64, 4, False)
    b1d = base.resolve(*tp8, pairs=1, dense_mid=True)
    assert (b1d.heads, b1d.block_t, b1d.num_warps, b1d.q_loop) == (8, 128, 8, False)
    f1, f4, f16 = (base.resolve(*full, pairs=p) for p in (1, 4, 16))
    assert (f1.heads, f1.block_t, f1.num_warps) == (16, 128, 8)
    assert (f4.heads, f4.block_t, f4.num_warps) == (16, 64, 4)
    assert f16 == base.resolve(*full) and (f16.heads, f16.block_t) == (32, 32)
    assert base.resolve(*full, pairs=4, dense_mid=True) == base.resolve(*full)  # bf16 latent: defaults won
    assert GeoConfig(block_t=32).resolve(*full, pairs=4).block_t == 32  # the caller's field stays
    assert base.resolve(1, 128, 192, False, pairs=1) == base.resolve(1, 128, 192, False)  # K192/V128: no change
