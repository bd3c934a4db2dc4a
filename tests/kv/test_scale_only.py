"""Scale-only groups (TensorQuant zero "none"): the grid centred on 0, no zero stored.

x_hat = (codes - mid) * scale, mid = (2**bits - 1) / 2. What must hold: the recipe field parses and
validates with one-line errors; the codec stores codes + scale only and round-trips; held bits and the
cache's measured bytes count one fp16 per group (int2 at group 64: 2.25 b/elt); every middle row of a
real cache goes through TensorCodec.encode; the torch attention path and the fused kernel (interpreter)
read it and agree with the torch twin.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.codec import TensorCodec
from lowbit.kv.held import held_bits, held_bits_of_cache
from lowbit.kv.scheme import TensorQuant, kv_scheme_from_dict, parse_kv_scheme
from lowbit.models import ModelGeometry
from lowbit.models.tiny import tiny_config
from lowbit.quant import affine, packing
from lowbit.runtime.cache import QuantizedKVCache


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ recipe
def test_recipe_field_parses_validates_and_round_trips():
    s = parse_kv_scheme("int2", zero="none")
    assert s.k.zero == s.v.zero == "none" and s.k.grid == "std" and not s.k.stores_zero
    assert s.bits_per_element(64) == (2.25, 2.25)  # 2 + 16/64: the point of it
    assert parse_kv_scheme("int2").bits_per_element(64) == (2.5, 2.5)
    assert parse_kv_scheme("k4v2", zero="group,none").bits_per_element(64) == (4.5, 2.25)
    assert "scale-only" in s.describe()
    assert kv_scheme_from_dict(s.to_dict()) == s
    assert kv_scheme_from_dict({"scheme": "int2", "zero": "none"}) == s
    t = kv_scheme_from_dict({"scheme": "int2", "k": {"bits": 2, "zero": "none", "grid": "std"}})
    assert t.k.zero == "none" and t.v.zero == "group"
    # per-layer overrides keep scale-only storage at the new width (std grid at 4, symmetric at 8)
    w = parse_kv_scheme("int2", zero="none", layer_bits="1=k4v8;2=bf16")
    assert w.for_layer(1).k == TensorQuant(bits=4, grid="std", zero="none")
    assert w.for_layer(1).v == TensorQuant(bits=8, symmetric=True, zero="none")
    assert w.for_layer(1).bits_per_element(64) == (4.25, 8.25)
    assert not w.for_layer(2).k.quantized


@pytest.mark.parametrize("kw,match", [
    ({"zero": "half"}, "zero 'half' unknown"),
    ({"zero": "none", "grid": "minmax"}, "centres the grid on 0"),
    ({"zero": "none", "lloyd_max": True}, "Lloyd-Max"),
])
def test_bad_zero_is_one_line_error(kw, match):
    with pytest.raises(LowbitError, match=match) as e:
        parse_kv_scheme("int2", **kw)
    assert "\n" not in str(e.value)


def test_channel_axis_refuses_scale_only():
    with pytest.raises(LowbitError, match="per-token groups"):
        parse_kv_scheme("kivi2", zero="none")
    with pytest.raises(LowbitError, match="unknown field"):
        kv_scheme_from_dict({"scheme": "int2", "k": {"zeros": "none"}})


# ------------------------------------------------------------------ quantizer and codec
@pytest.mark.parametrize("bits,group,D,grid", [(2, 64, 64, "std"), (3, 16, 48, "std"), (4, 32, 96, "std"),
                                               (8, 64, 64, "absmax"), (2, 5, 15, "absmax")])
def test_centred_quantizer_round_trip_odd_sizes(bits, group, D, grid):
    x = _x(3, 1, 7, D, seed=bits)
    x[0, 0, 0, :group] = 0.0  # an all-zero group reconstructs exactly (scale 0)
    q = affine.quantize_centred(x, bits, group, grid=grid, scale_dtype=torch.float16)
    mid = affine.centre(bits)
    xh = affine.dequantize(q)
    cg = q.codes.float().reshape(*x.shape[:-1], D // group, group)
    manual = ((cg - mid) * q.scale.float().unsqueeze(-1)).reshape(x.shape)
    assert torch.equal(xh, manual)  # the ONE formula with zero = -mid * scale
    assert torch.all(xh[0, 0, 0, :group] == 0)
    step = q.scale.float().repeat_interleave(group, -1)
    inside = x.abs() <= step * (mid + 0.5)  # values inside the grid: within half a step
    assert torch.all((xh - x).abs()[inside] <= step[inside] * 0.5 + 1e-6)
    assert inside.float().mean() > 0.9


@pytest.mark.parametrize("bits,D", [(2, 64), (4, 48), (3, 16)])
def test_codec_stores_codes_and_scale_only(bits, D):
    B, H, T = 2, 3, 5
    c = TensorCodec(TensorQuant(bits=bits, grid="std", zero="none"), D, page=4)
    assert set(c.fields()) == {"codes", "scale"}
    x = _x(B, H, T, D, seed=D)
    enc = c.encode(x, torch.float32)
    assert set(enc) == {"codes", "scale"} and enc["scale"].dtype == torch.float16
    assert enc["scale"].shape == (B, H, T, D // c.group)
    q = affine.quantize_centred(x, bits, c.group, scale_dtype=torch.float16)
    cb = 4 if bits == 3 else bits
    assert torch.equal(enc["codes"], packing.pack(q.codes, cb, "strided"))
    assert torch.allclose(c.decode(enc), affine.dequantize(q), atol=0)
    # on zero-mean data it reconstructs about as well as the std grid with a stored zero
    g = TensorCodec(TensorQuant(bits=bits, grid="std"), D, page=4)
    e_none = (c.decode(enc) - x).pow(2).mean()
    e_group = (g.decode(g.encode(x, torch.float32)) - x).pow(2).mean()
    assert e_none < 1.25 * e_group


# ------------------------------------------------------------------ cache: held bits, the one quantizer
def _geometry(name="smollm2-135m", layers=3):
    cfg = tiny_config(name, num_layers=layers)
    return cfg, ModelGeometry.from_config(cfg, name="tiny")


def _fill(cache, geometry, n, chunk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    fed = 0
    while fed < n:
        c = min(chunk, n - fed)
        for g in geometry.layers:
            cache.layers[g.index].update(torch.randn(1, g.num_kv_heads, c, g.head_dim_k, generator=gen),
                                         torch.randn(1, g.num_kv_heads, c, g.head_dim_v, generator=gen))
        fed += c


def test_held_bits_equal_the_bytes_the_cache_holds():
    cfg, geo = _geometry()
    s = parse_kv_scheme("int2", zero="none", sink=16, recent=32, layer_bits="1=k4v2")
    cache = QuantizedKVCache(cfg, s, geometry=geo)
    _fill(cache, geo, 301, 37)
    plan, live = held_bits(s, 301, geometry=geo, chunk=37), held_bits_of_cache(cache)
    assert plan.bits == pytest.approx(live.bits, rel=1e-12)
    bk, bv = cache.memory().middle_bits_per_element()
    assert bv == pytest.approx(2 + 16 / 64)  # measured from the held tensors: no zero buffer
    assert bk == pytest.approx((2 * 2.25 + 4.25) / 3)  # layer 1 K at int4, scale only
    for layer in cache.layers:
        assert "zero" not in layer.mid["k"] and "zero" not in layer.mid["v"]


def test_every_middle_row_goes_through_the_codec(monkeypatch):
    """Poison TensorCodec.encode: every middle row of a scale-only cache must decode to the sentinel."""
    from lowbit.models.tiny import tiny_tokenizer_free_inputs

    from .helpers import fast_model, run_chunks

    model = fast_model("smollm2-135m")
    orig, calls = TensorCodec.encode, []

    def poisoned(self, x, dense_dtype, **kw):
        calls.append(self.tq.zero)
        return orig(self, torch.full_like(x, 3.0), dense_dtype, **kw)

    monkeypatch.setattr(TensorCodec, "encode", poisoned)
    s = parse_kv_scheme("int2", zero="none", sink=2, recent=4, page=2, rotation="hadamard")
    cache = QuantizedKVCache(model, s)
    ids = tiny_tokenizer_free_inputs(model.config, 1, 23, seed=1)
    run_chunks(model, cache, ids, None, [9, 1, 1, 1, 5, 1, 5])
    assert calls and set(calls) == {"none"}
    for layer in cache.layers:
        k, v = layer.middle_dequantized()
        assert layer.mid_len and k.shape[-2] == layer.mid_len
        # 3.0 is not on a centred grid of a constant group: (c - 1.5) * s with s = U * 3; the codec's own value
        want = TensorCodec(layer.k_codec.tq, 64, 2)
        ref = want.decode(want.encode(torch.full((1, 1, 1, 64), 3.0), torch.float32))
        assert torch.allclose(k, ref.expand_as(k)) and torch.allclose(v, ref.expand_as(v))


def test_torch_attention_reads_scale_only_storage():
    """Through a real model: a scale-only cache's logits are close to bf16's, and its stored tiers decode
    to what TensorCodec.decode gives (the reference path reads the same fields)."""
    from lowbit.models.tiny import tiny_tokenizer_free_inputs

    from .helpers import fast_model, run_chunks

    model = fast_model("smollm2-135m")
    ids = tiny_tokenizer_free_inputs(model.config, 1, 41, seed=2)
    exact = QuantizedKVCache(model, parse_kv_scheme("bf16", sink=2, recent=4, page=2))
    a = run_chunks(model, exact, ids, None, [20, 1, 20])
    err = {}
    for name in ("int2", "int4"):
        for zero in ("none", "group"):
            cache = QuantizedKVCache(model, parse_kv_scheme(name, zero=zero, sink=2, recent=4, page=2))
            b = run_chunks(model, cache, ids, None, [20, 1, 20])
            assert cache.quantized_rows_total() > 0
            err[(name, zero)] = float((a - b).pow(2).mean() / a.pow(2).mean())
    assert err[("int4", "none")] < 0.01 and err[("int4", "none")] < err[("int2", "none")] / 4
    assert err[("int2", "none")] < 1.5 * err[("int2", "group")]  # zero-mean (rotated) K/V: the zero buys little


def test_cli_flag_and_plan_label():
    import argparse

    from lowbit.commands._kv_flags import add_kv_arguments, scheme_from_args
    from lowbit.kv.plan import resolve

    p = argparse.ArgumentParser()
    add_kv_arguments(p)
    s = scheme_from_args(p.parse_args(["--kv", "k4v2", "--zero", "group,none"]))
    assert s.k.zero == "group" and s.v.zero == "none" and s.v.grid == "std"
    with pytest.raises(LowbitError, match="zero 'nil' unknown"):
        scheme_from_args(p.parse_args(["--kv", "int2", "--zero", "nil"]))
    _, geo = _geometry()
    plan = resolve(s, geo)
    assert plan.layers[0].k.stores_zero and not plan.layers[0].v.stores_zero
    assert "s-only" in plan.table() and plan.to_dict()["layers"][0]["v"]["zero"] == "none"
