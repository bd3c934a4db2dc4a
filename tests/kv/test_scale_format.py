"""One-byte scales (TensorQuant scale_format "ue5m3", lowbit.quant.scale_format) for scale-only groups.

What must hold: the 256 codes decode to the documented values and encode back exactly; encode picks the
nearest value (checked against a brute-force search); the quantizer codes against the rounded step; the
recipe field parses, validates with one-line errors and round-trips; the codec stores uint8 scales and the
held bits count 8 bits per group (int2 at group 64: 2.125 b/elt); the torch path, the fused kernel
(interpreter) through the eager cache, and the static runtime (wrapper and custom op) read them alike;
readers that cannot (the geometry kernel) refuse by name.
"""

from __future__ import annotations

import math

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.codec import TensorCodec
from lowbit.kv.held import held_bits, held_bits_of_cache
from lowbit.kv.scheme import TensorQuant, kv_scheme_from_dict, parse_kv_scheme
from lowbit.models import ModelGeometry
from lowbit.models.tiny import tiny_config, tiny_tokenizer_free_inputs
from lowbit.quant import affine, packing
from lowbit.quant import scale_format as sf
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import fast_model, rel_err, run_chunks


# ------------------------------------------------------------------ the format
def test_every_code_decodes_to_its_documented_value_and_back():
    codes = torch.arange(256, dtype=torch.int64)
    vals = sf.decode(codes.to(torch.uint8))
    for c in range(256):  # the docstring's formula, in Python floats
        e, m = c >> 3, c & 7
        want = (1 + m / 8) * 2.0 ** (e - 15) if e else m * 2.0**-17
        assert float(vals[c]) == want, c
    assert torch.all(vals[1:] > vals[:-1])  # codes ordered like their values
    assert float(vals[0]) == 0.0 and float(vals[-1]) == sf.MAX_VALUE
    assert torch.equal(sf.encode(vals), codes.to(torch.uint8))  # exhaustive round trip
    # the kernel's bit trick: a normal code is the fp32 with exponent field E + 112 and mantissa M << 20
    e, m = codes >> 3, codes & 7
    bits = (((e + 112) << 23) | (m << 20)).to(torch.int32).view(torch.float32)
    assert torch.equal(torch.where(e > 0, bits, m.float() * 2.0**-17), vals)


def test_encode_is_nearest_value():
    g = torch.Generator().manual_seed(0)
    s = torch.cat([torch.rand(4000, generator=g) * 10.0 ** torch.randint(-6, 5, (4000,), generator=g),
                   torch.tensor([0.0, 1e-9, 2.0**-17, 3 * 2.0**-18, 1.0, 1.0625, 2e5])])
    got = sf.round_to_grid(s)
    dist = (s[:, None].double() - sf.values().double()[None, :]).abs()
    best = dist.min(dim=1).values
    assert torch.all((got.double() - s.double()).abs() <= best + 1e-12)
    assert float(sf.round_to_grid(torch.tensor([2e5]))) == sf.MAX_VALUE  # saturates, never inf
    normal = (s >= 2.0**-14) & (s <= sf.MAX_VALUE)
    assert float(((got - s).abs() / s)[normal].max()) <= 1 / 17 + 1e-6  # 3 mantissa bits, round to nearest


def test_decode_refuses_a_non_byte_tensor():
    with pytest.raises(LowbitError, match="uint8"):
        sf.decode(torch.zeros(3))


# ------------------------------------------------------------------ the quantizer and the codec
@pytest.mark.parametrize("bits,group,D,search", [(2, 64, 64, ()), (2, 32, 64, affine.MSE_STEPS), (4, 64, 128, ()),
                                                 (3, 16, 48, affine.MSE_STEPS)])
def test_quantizer_codes_against_the_rounded_step(bits, group, D, search):
    x = torch.randn(2, 3, 17, D, generator=torch.Generator().manual_seed(bits)) * 0.3
    x[0, 0, 0, :group] = 0.0
    q = affine.quantize_centred(x, bits, group, scale_dtype=torch.float32, scale_format="ue5m3", search=search)
    assert torch.equal(sf.round_to_grid(q.scale), q.scale)  # every stored step is a UE5M3 value
    mid = affine.centre(bits)
    xg = x.reshape(*x.shape[:-1], D // group, group)
    live = q.scale > 0
    inv = torch.where(live, 1 / torch.where(live, q.scale, torch.ones_like(q.scale)), torch.zeros_like(q.scale))
    want = torch.round(xg * inv[..., None] + mid).clamp(0, (1 << bits) - 1)
    assert torch.equal(q.codes.reshape(want.shape).float(), want)
    assert torch.all(affine.dequantize(q)[0, 0, 0, :group] == 0)
    q16 = affine.quantize_centred(x, bits, group, scale_dtype=torch.float16, search=search)
    e8 = (affine.dequantize(q) - x).pow(2).mean()
    e16 = (affine.dequantize(q16) - x).pow(2).mean()
    assert e8 < 1.1 * e16  # a 1/16 step error costs little squared error


def test_quantizer_refuses_a_format_with_a_narrow_dtype():
    with pytest.raises(LowbitError, match="float32"):
        affine.quantize_centred(torch.randn(2, 64), 2, 64, scale_format="ue5m3", scale_dtype=torch.float16)
    with pytest.raises(LowbitError, match="unknown"):
        affine.quantize_centred(torch.randn(2, 64), 2, 64, scale_format="e4m3")


@pytest.mark.parametrize("bits,D", [(2, 64), (4, 128), (3, 48)])
def test_codec_stores_byte_scales_and_decodes_them(bits, D):
    tq = TensorQuant(bits=bits, grid="mse", zero="none", scale_format="ue5m3")
    c = TensorCodec(tq, D, page=4)
    x = torch.randn(2, 3, 5, D, generator=torch.Generator().manual_seed(D))
    enc = c.encode(x, torch.float32)
    assert set(enc) == {"codes", "scale"} and enc["scale"].dtype == torch.uint8
    q = affine.quantize_centred(x, bits, c.group, scale_dtype=torch.float32, scale_format="ue5m3",
                                search=affine.MSE_STEPS)
    assert torch.equal(enc["codes"], packing.pack(q.codes, c.cbits, "strided"))
    assert torch.equal(c.decode(enc), affine.dequantize(q))
    assert c.field_dtype("scale", torch.bfloat16) == torch.uint8 and c.field_bits("scale") == 8


# ------------------------------------------------------------------ recipe
def test_recipe_field_parses_validates_and_round_trips():
    s = parse_kv_scheme("int2", zero="none", grid="mse", group=64, scale_format="ue5m3")
    assert s.k.scale_format == s.v.scale_format == "ue5m3"
    assert s.bits_per_element(64) == (2.125, 2.125)  # 2 + 8/64
    assert "ue5m3 scales" in s.k.describe()
    assert kv_scheme_from_dict(s.to_dict()) == s
    f = kv_scheme_from_dict({"scheme": "int2", "zero": "none", "grid": "mse", "group": 64, "scale_format": "ue5m3",
                             "layer_bits": {"1": "k4v2", "2": "bf16"}})
    assert f.for_layer(1).k == TensorQuant(bits=4, grid="mse", zero="none", group=64, scale_format="ue5m3")
    assert f.for_layer(1).bits_per_element(64) == (4.125, 2.125)
    assert not f.for_layer(2).k.quantized and f.for_layer(2).k.scale_format == "fp16"
    mixed = parse_kv_scheme("k4v2", zero="none", scale_format="fp16,ue5m3", group=64)
    assert mixed.bits_per_element(64) == (4.25, 2.125)


@pytest.mark.parametrize("kw,match", [
    ({"scale_format": "e4m3", "zero": "none"}, "scale_format 'e4m3' unknown"),
    ({"scale_format": "ue5m3"}, "set zero 'none'"),
])
def test_bad_scale_format_is_one_line_error(kw, match):
    with pytest.raises(LowbitError, match=match) as e:
        parse_kv_scheme("int2", **kw)
    assert "\n" not in str(e.value)


def test_cli_flag():
    import argparse

    from lowbit.commands._kv_flags import add_kv_arguments, scheme_from_args

    p = argparse.ArgumentParser()
    add_kv_arguments(p)
    s = scheme_from_args(p.parse_args(["--kv", "int2", "--zero", "none", "--scale-format", "ue5m3"]))
    assert s.v.scale_format == "ue5m3"
    from lowbit.kv.plan import resolve

    plan = resolve(s, ModelGeometry.from_config(tiny_config("smollm2-135m", num_layers=2), name="tiny"))
    assert "s-only ue5m3" in plan.table()
    v = scheme_from_args(p.parse_args(["--kv", "int2", "--zero", "none", "--vq", "none,4x256"]))
    assert v.k.vq is None and v.v.vq == "4x256"
    with pytest.raises(LowbitError, match="scale_format 'fp8' unknown"):
        scheme_from_args(p.parse_args(["--kv", "int2", "--zero", "none", "--scale-format", "fp8"]))


# ------------------------------------------------------------------ cache: held bits and readers
def test_held_bits_equal_the_bytes_the_cache_holds():
    cfg = tiny_config("smollm2-135m", num_layers=3)
    geo = ModelGeometry.from_config(cfg, name="tiny")
    s = parse_kv_scheme("int2", zero="none", sink=16, recent=32, layer_bits="1=k4v2", scale_format="ue5m3")
    cache = QuantizedKVCache(cfg, s, geometry=geo)
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        for g in geo.layers:
            cache.layers[g.index].update(torch.randn(1, g.num_kv_heads, 37, g.head_dim_k, generator=gen),
                                         torch.randn(1, g.num_kv_heads, 37, g.head_dim_v, generator=gen))
    plan, live = held_bits(s, 8 * 37, geometry=geo, chunk=37), held_bits_of_cache(cache)
    assert plan.bits == pytest.approx(live.bits, rel=1e-12)
    bk, bv = cache.memory().middle_bits_per_element()
    assert bv == pytest.approx(2 + 8 / 64)  # measured from the held tensors
    assert bk == pytest.approx((2 * 2.125 + 4.125) / 3)
    assert all(layer.mid["k"]["scale"].dtype == torch.uint8 for layer in cache.layers)


def test_torch_path_reads_byte_scales_about_as_well_as_fp16():
    model = fast_model("smollm2-135m")
    ids = tiny_tokenizer_free_inputs(model.config, 1, 41, seed=2)
    a = run_chunks(model, QuantizedKVCache(model, parse_kv_scheme("bf16", sink=2, recent=4, page=2)), ids, None,
                   [20, 1, 20])
    err = {}
    for fmt in ("fp16", "ue5m3"):
        cache = QuantizedKVCache(model, parse_kv_scheme("int2", zero="none", sink=2, recent=4, page=2, scale_format=fmt))
        b = run_chunks(model, cache, ids, None, [20, 1, 20])
        assert cache.quantized_rows_total() > 0
        err[fmt] = float((a - b).pow(2).mean() / a.pow(2).mean())
    assert 0 < err["ue5m3"] < 1.5 * err["fp16"]


def test_cache_decodes_through_kernel_like_torch_path():
    """The plan routes a ue5m3 layer's decode to the fused kernel (uint8 scales decoded in the kernel)."""
    from lowbit.kernels.attention.common import interpreted
    from lowbit.kv.plan import resolve
    from lowbit.models.tiny import tiny_model

    if not interpreted():
        pytest.skip("the kernels were imported for CUDA (TRITON_INTERPRET=0)")
    model, cfg = tiny_model("smollm2-135m", num_layers=1, dtype=torch.float32)
    s = parse_kv_scheme("k4v2", zero="none", sink=2, recent=4, page=2, scale_format="ue5m3")
    plan = resolve(s, ModelGeometry.from_config(cfg), decode_backend="triton")
    assert plan.layers[0].backends["decode"].name == "triton-decode"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (3, 45), generator=g)
    steps = torch.randint(0, cfg.vocab_size, (3, 3), generator=g)
    logits = {}
    for backend in ("torch", "triton"):
        cache = QuantizedKVCache(model, s, decode_backend=backend)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            out = [model(input_ids=steps[:, i:i + 1], past_key_values=cache, use_cache=True).logits[:, -1]
                   for i in range(steps.shape[1])]
        logits[backend] = torch.stack(out)
        if backend == "triton":
            assert cache.backend_calls.get("triton", 0) == 3
    assert rel_err(logits["triton"], logits["torch"]) < 1e-3


def test_kernel_decodes_the_byte_not_its_integer_value():
    """The audit's twin agrees; the same case with the scale bytes read as plain numbers would not."""
    from lowbit.kernels.attention.common import interpreted
    from lowbit.kernels.attention.reference import decode_attention_ref
    from lowbit.kernels.attention.tiers import KernelConfig, decode_attention
    from lowbit.tools.audit.attention import TOL, audit, make_case

    if not interpreted():
        pytest.skip("the kernels were imported for CUDA (TRITON_INTERPRET=0)")
    case = {"B": 3, "Hq": 9, "Hkv": 3, "D": 64, "T": 99, "kbits": 4, "vbits": 2, "zero": "none",
            "scale_format": "ue5m3", "ragged": True, "sink": 3, "recent": 5}
    (row,) = audit("cpu", cases=[("ue5m3", case)], kernels=("decode_attention",))
    assert row.ok and row.finite, row
    kw = make_case(**case)
    assert kw["k_scale"].dtype == torch.uint8
    ref = decode_attention_ref(**kw)
    cfg = KernelConfig(warp_tokens=16, num_warps=2, num_splits=3, dense_block=16)
    got = decode_attention(**kw, config=cfg).float()
    as_fp16 = {**kw, "k_scale": sf.decode(kw["k_scale"]).half(), "v_scale": sf.decode(kw["v_scale"]).half()}
    assert rel_err(got, decode_attention(**as_fp16, config=cfg).float()) < 1e-4  # values exact in fp16 too
    wrong = {**kw, "k_scale": kw["k_scale"].half() * 2.0**-10, "v_scale": kw["v_scale"].half() * 2.0**-10}
    assert float((decode_attention(**wrong, config=cfg).float() - ref).norm() / ref.norm()) > 10 * TOL


def test_geometry_kernel_refuses_byte_scales_by_name():
    from lowbit.kernels.attention.common import check_packed_tier

    codes = torch.zeros(1, 1, 4, 24, dtype=torch.uint8)
    scale = torch.zeros(1, 1, 4, 1, dtype=torch.uint8)
    with pytest.raises(LowbitError, match="one-byte .ue5m3. scales are read by the head_dim 64/128/256 kernel"):
        check_packed_tier(codes, scale, scale, 2, 1, 1, 96, torch.device("cpu"), "K middle")
    with pytest.raises(LowbitError, match="scale-only"):
        check_packed_tier(codes, scale, scale.clone(), 2, 1, 1, 96, torch.device("cpu"), "K middle",
                          one_byte_scales=True)


def test_static_runtime_reads_byte_scales_like_the_eager_cache():
    """The static cache allocates uint8 scales; torch path, the kernel's wrapper and the custom op agree with
    the eager cache's logits."""
    from lowbit.kernels.attention.common import interpreted
    from lowbit.kv.plan import resolve
    from lowbit.runtime.static_cache import StaticKVCache
    from lowbit.runtime.step import ModelStep, eager_decode, prefill

    m = fast_model("smollm2-135m")
    geo = ModelGeometry.from_config(m.config, name="smollm2-135m")
    plan = resolve(parse_kv_scheme("k4v2", zero="none", sink=4, recent=8, page=1, scale_format="ue5m3"), geo)
    ids = tiny_tokenizer_free_inputs(m.config, 2, 24, seed=4)
    ref = torch.stack([run_chunks(m, QuantizedKVCache.from_plan(m, plan), ids[b:b + 1, :23], None, [8, 8, 4, 1, 1, 1])
                       [0, 19:] for b in range(2)])  # positions 19..22: the last prompt token and 3 steps
    step = ModelStep(m)
    modes = ((False, False), (True, False), (True, True)) if interpreted() else ((False, False),)
    for use_kernel, kernel_op in modes:
        st = StaticKVCache(m, plan, slots=2, max_context=32)
        st.use_kernel, st.kernel_op = use_kernel, kernel_op
        assert all(layer.mid["v"]["scale"].dtype == torch.uint8 for layer in st.layers if layer.kind == "tiers")
        first = [prefill(step, st, b, ids[b, :20], chunk=8) for b in range(2)]
        on = torch.ones(2, dtype=torch.bool)
        out = torch.stack([torch.stack(first)] + [eager_decode(step, st, ids[:, 20 + t:21 + t], on) for t in range(3)], 1)
        assert rel_err(out, ref) < 1e-3, (use_kernel, kernel_op)
    assert math.isfinite(float(out.abs().max()))
