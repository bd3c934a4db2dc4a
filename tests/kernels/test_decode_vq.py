"""The VQ-row decode kernel (lowbit.kernels.attention.vq) against its torch twin at odd sizes (Triton interpreter
on CPU), a control that a kernel ignoring the codebook would fail, the bad inputs named, and the eager cache
routing a VQ layer's decode to it with the torch path's logits."""

from __future__ import annotations

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels.attention.common import interpreted
from lowbit.kernels.attention.reference import decode_attention_vq_ref
from lowbit.kernels.attention.vq import MidTensor, decode_attention_vq
from lowbit.tools.audit.attention import RES_K, RES_V, TOL, VQ_K, VQ_V, audit_vq, make_vq_case

pytestmark = pytest.mark.skipif(not interpreted(), reason="kernels imported for CUDA (TRITON_INTERPRET=0)")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _eager_logits(model, cfg, scheme, seed: int = 0) -> dict:
    """{backend: logits of 3 decode steps after a 45-token prefill} through the eager cache, torch and triton
    (the fused kernels), same tokens; the triton caches count their kernel calls."""
    from lowbit.runtime.cache import QuantizedKVCache

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (3, 45), generator=g)
    steps = torch.randint(0, cfg.vocab_size, (3, 3), generator=g)
    out = {}
    for backend in ("torch", "triton"):
        cache = QuantizedKVCache(model, scheme, decode_backend=backend)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            out[backend] = torch.stack([model(input_ids=steps[:, i:i + 1], past_key_values=cache,
                                              use_cache=True).logits[:, -1] for i in range(3)])
        out[backend + "_calls"] = cache.backend_calls.get(backend, 0)
    return out


def _static_matches_eager(m, plan, monkeypatch, vq_layers) -> None:
    """The static cache's decode steps through the VQ kernel's op (use_kernel) and through its torch path give the
    eager cache's logits; the op runs exactly when use_kernel is set; vq_layers: which layers' StaticLayer.vq."""
    from lowbit.models.tiny import tiny_tokenizer_free_inputs
    from lowbit.runtime.cache import QuantizedKVCache
    from lowbit.runtime.static_cache import StaticKVCache
    from lowbit.runtime.step import ModelStep, eager_decode, prefill
    from tests.kv.helpers import run_chunks

    ids = tiny_tokenizer_free_inputs(m.config, 2, 24, seed=4)
    ref = torch.stack([run_chunks(m, QuantizedKVCache.from_plan(m, plan), ids[b:b + 1, :23], None, [8, 8, 4, 1, 1, 1])
                       [0, 19:] for b in range(2)])
    import lowbit.kernels.attention.vq as dvq

    calls, real = [], dvq.decode_attention_vq
    monkeypatch.setattr(dvq, "decode_attention_vq", lambda *a, **k: calls.append(1) or real(*a, **k))
    step = ModelStep(m)
    for use_kernel in (False, True):
        st = StaticKVCache(m, plan, slots=2, max_context=32)
        st.use_kernel = use_kernel
        assert [layer.vq for layer in st.layers][:len(vq_layers)] == list(vq_layers)
        first = [prefill(step, st, b, ids[b, :20], chunk=8) for b in range(2)]
        on = torch.ones(2, dtype=torch.bool)
        out = torch.stack([torch.stack(first)] + [eager_decode(step, st, ids[:, 20 + t:21 + t], on) for t in range(3)], 1)
        assert _rel(out, ref) < 1e-3, use_kernel
        assert bool(calls) == use_kernel  # the VQ layers' steps through the op, or none
        calls.clear()


@pytest.mark.parametrize("B,Hq,Hkv,D,T,k,v,extra", [
    (1, 1, 1, 16, 1, ("vq", 2, 16, "fp16"), ("vq", 2, 16, "fp16"), {}),
    (3, 9, 3, 64, 17, VQ_K, VQ_V, {"ragged": True, "sink": 3, "recent": 5}),
    (2, 8, 2, 64, 999, ("scalar", 4, 64, "ue5m3"), VQ_V, {"recent": 7}),
    (1, 4, 1, 256, 99, ("vq", 4, 256, "fp16"), ("scalar", 8, 128, "fp16"), {"sink": 1}),
    (2, 6, 2, 32, 3, ("vq", 1, 16, "ue5m3"), ("vq", 8, 256, "ue5m3"), {"ragged": True}),
])
def test_kernel_matches_twin_at_odd_sizes(B, Hq, Hkv, D, T, k, v, extra):
    kw = make_vq_case(B, Hq, Hkv, D, T, k, v, **extra, seed=T)
    out = decode_attention_vq(**kw, num_splits=3)
    assert torch.isfinite(out.float()).all()
    assert _rel(out, decode_attention_vq_ref(**kw)) < 5e-3  # bf16 output rounding


def test_audit_cases_pass_and_a_wrong_codebook_shows():
    rows = audit_vq("cpu")
    assert rows and all(r.ok and r.finite for r in rows), rows
    kw = make_vq_case(3, 9, 3, 64, 99, VQ_K, VQ_V, ragged=True)
    ref = decode_attention_vq_ref(**kw)
    km = kw["k_mid"]
    other = MidTensor(km.codes, km.scale, km.bits, km.codebook.flip(1))  # the same codes read in another book
    out = decode_attention_vq(**{**kw, "k_mid": other}, num_splits=2).float()
    assert _rel(out, ref) > 10 * TOL


def test_dense_only_and_empty_middle():
    kw = make_vq_case(2, 4, 1, 64, 5, VQ_K, VQ_V, sink=4, recent=6)
    dense = {n: kw[n] for n in ("q", "sink_k", "sink_v", "recent_k", "recent_v", "recent_lens")}
    out = decode_attention_vq(**dense, k_mid=None, v_mid=None)
    assert _rel(out, decode_attention_vq_ref(**dense, k_mid=None, v_mid=None)) < 5e-3
    kw["mid_lens"] = torch.zeros(2, dtype=torch.int32)  # nothing valid in the middle: the dense tiers alone
    assert _rel(decode_attention_vq(**kw), decode_attention_vq_ref(**dense, k_mid=None, v_mid=None)) < 5e-3


def test_bad_inputs_are_named():
    kw = make_vq_case(1, 4, 2, 64, 8, VQ_K, VQ_V)
    km = kw["k_mid"]
    with pytest.raises(LowbitError, match="codebook must be"):
        decode_attention_vq(**{**kw, "k_mid": MidTensor(km.codes, km.scale, 2, km.codebook[:1])})
    with pytest.raises(LowbitError, match="stores 4 bits"):
        decode_attention_vq(**{**kw, "k_mid": MidTensor(km.codes, km.scale, 2, torch.zeros(2, 256, 2).half())})
    with pytest.raises(LowbitError, match="together"):
        decode_attention_vq(kw["q"], km, None)
    q = torch.randn(1, 4, 48)
    with pytest.raises(LowbitError, match="power-of-two head dims"):
        decode_attention_vq(q, None, None, sink_k=torch.randn(1, 2, 3, 48), sink_v=torch.randn(1, 2, 3, 48))


def test_cache_routes_vq_layers_to_the_kernel_like_the_torch_path(tmp_path):
    from lowbit.kv.plan import resolve, save_levels
    from lowbit.kv.scheme import LevelsRef, parse_kv_scheme
    from lowbit.models import ModelGeometry
    from lowbit.models.tiny import tiny_model

    model, cfg = tiny_model("smollm2-135m", num_layers=2, dtype=torch.float32)
    geo = ModelGeometry.from_config(cfg)
    H = geo.layers[0].num_kv_heads
    g = torch.Generator().manual_seed(0)
    cb = save_levels(tmp_path / "cb", {0: {"k": torch.randn(H, 16, 2, generator=g), "v": torch.randn(H, 256, 4, generator=g)},
                                       1: {"v": torch.randn(H, 256, 4, generator=g)}}, model=geo.name)
    s = parse_kv_scheme("int2", zero="none", sink=2, recent=4, page=2, vq="2x16,4x256", layer_bits="1=k4v2",
                        scale_format="ue5m3", levels=LevelsRef(str(cb)))
    plan = resolve(s, geo, decode_backend="triton")
    assert {lp.backends["decode"].name for lp in plan.layers} == {"triton-decode"}
    from lowbit.kv.capabilities import kernel_name

    assert kernel_name(plan.layers[1]) == "decode_vq (VQ rows / 1-bit residual)"  # int4 scalar K beside VQ V
    logits = _eager_logits(model, cfg, s)
    assert logits["triton_calls"] == 6  # 2 layers x 3 steps
    assert _rel(logits["triton"], logits["torch"]) < 1e-3


def test_static_runtime_reads_vq_rows_through_the_kernel_op(tmp_path, monkeypatch):
    """The static cache holds VQ codes and one-byte row scales; its decode step through the VQ kernel's custom op
    (use_kernel, what a CUDA plan sets) and through its torch path give the eager cache's logits."""
    from lowbit.kv.plan import resolve, save_levels
    from lowbit.kv.scheme import LevelsRef, parse_kv_scheme
    from lowbit.models import ModelGeometry
    from tests.kv.helpers import fast_model

    m = fast_model("smollm2-135m")
    geo = ModelGeometry.from_config(m.config, name="smollm2-135m")
    H, n = geo.layers[0].num_kv_heads, geo.num_layers
    g = torch.Generator().manual_seed(3)
    cbs = {i: {"k": torch.randn(H, 16, 2, generator=g) if i != 1 else None, "v": torch.randn(H, 256, 4, generator=g)}
           for i in range(n)}
    cb = save_levels(tmp_path / "cb", cbs, model="smollm2-135m")
    s = parse_kv_scheme("int2", zero="none", sink=4, recent=8, page=1, vq="2x16,4x256", layer_bits="1=k4v2",
                        scale_format="ue5m3", levels=LevelsRef(str(cb)))
    _static_matches_eager(m, resolve(s, geo), monkeypatch, [True] * n)


# ------------------------------------------------------------------ the 1-bit residual (lowbit.quant.residual)
@pytest.mark.parametrize("B,Hq,Hkv,D,T,k,v,extra", [
    (1, 1, 1, 16, 1, ("scalar", 2, 16, "fp16", "sign"), ("scalar", 2, 16, "fp16", "qjl"), {}),
    (2, 6, 2, 64, 3, RES_K, RES_V, {"sink": 2}),
    (3, 9, 3, 64, 17, RES_K, ("scalar", 4, 32, "ue5m3"), {"ragged": True, "recent": 5}),
    (1, 8, 2, 128, 99, ("vq", 2, 16, "ue5m3", "qjl"), RES_V, {}),
    (2, 4, 1, 64, 999, ("scalar", 2, 64, "fp16"), ("vq", 4, 256, "fp16", "sign"), {"ragged": True}),
])
def test_residual_matches_twin_at_odd_sizes(B, Hq, Hkv, D, T, k, v, extra):
    kw = make_vq_case(B, Hq, Hkv, D, T, k, v, **extra, seed=T)
    out = decode_attention_vq(**kw, num_splits=3)
    assert torch.isfinite(out.float()).all()
    assert _rel(out, decode_attention_vq_ref(**kw)) < 5e-3


def test_a_kernel_ignoring_the_residual_would_fail():
    from dataclasses import replace

    kw = make_vq_case(2, 6, 2, 64, 45, RES_K, RES_V, ragged=False, seed=1)
    ref = decode_attention_vq_ref(**kw)
    assert _rel(decode_attention_vq(**kw, num_splits=2).float(), ref) < TOL * 5
    for which in ("k_mid", "v_mid"):
        dropped = replace(kw[which], rbits=None, rgain=None)
        out = decode_attention_vq(**{**kw, which: dropped}, num_splits=2).float()
        assert _rel(out, ref) > 10 * TOL, which
    with pytest.raises(LowbitError, match="both rbits and rgain"):
        decode_attention_vq(**{**kw, "k_mid": replace(kw["k_mid"], rgain=None)})
    with pytest.raises(LowbitError, match="rbits must be"):
        decode_attention_vq(**{**kw, "k_mid": replace(kw["k_mid"], rbits=kw["k_mid"].rbits[..., :4])})


def test_cache_routes_residual_layers_to_the_kernel_like_the_torch_path():
    from lowbit.kv.capabilities import kernel_name
    from lowbit.kv.plan import resolve
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.models import ModelGeometry
    from lowbit.models.tiny import tiny_model

    model, cfg = tiny_model("smollm2-135m", num_layers=3, dtype=torch.float32)
    geo = ModelGeometry.from_config(cfg)
    s = parse_kv_scheme("int2", zero="none", grid="mse", sink=2, recent=4, page=2, scale_format="ue5m3",
                        layer_bits="0=k2rv2;1=k4v2q")
    plan = resolve(s, geo, decode_backend="triton")
    assert [kernel_name(lp) for lp in plan.layers] == ["decode_vq (VQ rows / 1-bit residual)"] * 2 + ["decode_attention"]
    logits = _eager_logits(model, cfg, s)
    assert logits["triton_calls"] == 9  # 3 layers x 3 steps
    assert _rel(logits["triton"], logits["torch"]) < 1e-3


def test_static_runtime_reads_the_residual_through_the_kernel_op(monkeypatch):
    """The static cache holds the residual's sign bits and gains; its decode step through the VQ kernel's op and
    through its torch path give the eager cache's logits."""
    from lowbit.kv.plan import resolve
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.models import ModelGeometry
    from tests.kv.helpers import fast_model

    m = fast_model("smollm2-135m")
    geo = ModelGeometry.from_config(m.config, name="smollm2-135m")
    s = parse_kv_scheme("int2", zero="none", grid="mse", sink=4, recent=8, page=1, scale_format="ue5m3",
                        layer_bits="0=k2rv2q;1=k4v2")
    _static_matches_eager(m, resolve(s, geo), monkeypatch, [True, False])
