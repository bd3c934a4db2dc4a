"""The "mse" grid (TensorQuant grid "mse", scale-only groups): the std step searched per group at write time.

What must hold: per group, the searched reconstruction is never worse than the std grid's (1 is a
candidate) and is strictly better on heavy-tailed data; what is stored (codes + one fp16 scale) and
how it is read are the std scale-only grid's, so a std reader (and the fused kernel) decodes it
unchanged; the recipe field validates with one-line errors, survives layer_bits overrides and round
trips; a real cache's middle rows go through it; tune offers it as the "scale-only-mse" base.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.codec import TensorCodec
from lowbit.kv.scheme import TensorQuant, kv_scheme_from_dict, parse_kv_scheme
from lowbit.models import ModelGeometry
from lowbit.models.tiny import tiny_config
from lowbit.quant import affine
from lowbit.runtime.cache import QuantizedKVCache


def _heavy(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(*shape, generator=g).pow(3).mul(6).add(0.2)


def _group_err(x, q, group):
    e = (affine.dequantize(q) - x.float()).pow(2)
    return e.reshape(*x.shape[:-1], x.shape[-1] // group, group).sum(-1)


# ------------------------------------------------------------------ quantizer
@pytest.mark.parametrize("bits,group,D", [(2, 64, 64), (2, 5, 15), (3, 16, 48), (4, 32, 96), (2, 256, 256)])
def test_search_never_worse_per_group_and_better_on_heavy_tails(bits, group, D):
    x = _heavy(3, 1, 99, D, seed=bits + D)
    x[0, 0, 0, :group] = 0.0  # an all-zero group stays exact
    plain = affine.quantize_centred(x, bits, group, scale_dtype=torch.float16)
    srch = affine.quantize_centred(x, bits, group, scale_dtype=torch.float16, search=affine.MSE_STEPS)
    ep, es = _group_err(x, plain, group), _group_err(x, srch, group)
    assert torch.all(es <= ep * (1 + 1e-6) + 1e-12)
    assert es.sum() < 0.995 * ep.sum()  # the std step is not the best one for many groups
    assert torch.all(es[0, 0, 0, 0] == 0) and torch.all(srch.scale[0, 0, 0, 0] == 0)
    # the stored scale is one of the candidates' rounded steps, and the ONE formula reads it
    mid = affine.centre(bits)
    cg = srch.codes.float().reshape(*x.shape[:-1], D // group, group)
    assert torch.equal(affine.dequantize(srch), ((cg - mid) * srch.scale.float().unsqueeze(-1)).reshape(x.shape))
    ratio = srch.scale.float() / plain.scale.float()
    live = plain.scale.float() > 0
    near = torch.zeros_like(ratio, dtype=torch.bool)
    for f in affine.MSE_STEPS:
        near |= (ratio - f).abs() <= 2e-3 * f
    assert torch.all(near[live])
    assert (ratio[live] != 1).any()


def test_no_search_is_the_std_grid_bit_for_bit():
    x = _heavy(2, 3, 7, 64, seed=5)
    a = affine.quantize_centred(x, 2, 64, scale_dtype=torch.float16)
    b = affine.quantize_centred(x, 2, 64, scale_dtype=torch.float16, search=(1.0,))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    with pytest.raises(LowbitError, match="must be > 0"):
        affine.quantize_centred(x, 2, 64, search=(0.0,))


# ------------------------------------------------------------------ recipe
def test_recipe_field_validates_round_trips_and_survives_overrides():
    s = parse_kv_scheme("int2", zero="none", grid="mse", layer_bits="1=k4v8;2=bf16")
    assert s.k.grid == s.v.grid == "mse" and "mse-grid" in s.describe()
    assert s.bits_per_element(64) == parse_kv_scheme("int2", zero="none").bits_per_element(64) == (2.25, 2.25)
    assert s.for_layer(1).k == TensorQuant(bits=4, grid="mse", zero="none")  # 4 bits keeps the search
    assert s.for_layer(1).v == TensorQuant(bits=8, symmetric=True, zero="none")  # 8 bits: symmetric min/max
    assert kv_scheme_from_dict(s.to_dict()) == s
    assert kv_scheme_from_dict({"scheme": "int2", "zero": "none", "grid": "mse"}) == parse_kv_scheme(
        "int2", zero="none", grid="mse")
    for kw, match in (({"grid": "mse"}, "set zero 'none'"), ({"grid": "mse", "zero": "none", "lloyd_max": True}, "Lloyd-Max"),
                      ({"grid": "mse", "zero": "none", "clip": 0.9}, "clip")):
        with pytest.raises(LowbitError, match=match) as e:
            parse_kv_scheme("int2", **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(LowbitError, match="mse grid is for"):
        TensorQuant(bits=8, grid="mse", zero="none")


def test_cli_grid_flag():
    import argparse

    from lowbit.commands._kv_flags import add_kv_arguments, scheme_from_args

    p = argparse.ArgumentParser()
    add_kv_arguments(p)
    s = scheme_from_args(p.parse_args(["--kv", "k4v2", "--zero", "none", "--grid", "mse"]))
    assert s.k == TensorQuant(bits=4, grid="mse", zero="none") and s.v.grid == "mse"


# ------------------------------------------------------------------ codec: stored like std, read by std
@pytest.mark.parametrize("bits,D", [(2, 64), (4, 48), (2, 256)])
def test_codec_fields_and_a_std_reader_decode_it(bits, D):
    mse = TensorCodec(TensorQuant(bits=bits, grid="mse", zero="none"), D, page=4)
    std = TensorCodec(TensorQuant(bits=bits, grid="std", zero="none"), D, page=4)
    x = _heavy(2, 3, 11, D, seed=D)
    enc = mse.encode(x, torch.float32)
    assert set(enc) == {"codes", "scale"} and enc["scale"].dtype == torch.float16
    assert {k: v.shape for k, v in enc.items()} == {k: v.shape for k, v in std.encode(x, torch.float32).items()}
    assert torch.equal(std.decode(enc), mse.decode(enc))  # the reader does not know the encoder searched
    e_mse = (mse.decode(enc) - x).pow(2).sum()
    e_std = (std.decode(std.encode(x, torch.float32)) - x).pow(2).sum()
    assert e_mse < 0.995 * e_std


def test_cache_middle_rows_are_searched_and_never_worse():
    """A real cache (rotation none, so the middle holds the inputs): per layer the mse middle reconstructs
    the fed K/V at least as well as the std one, and better in total; the plan keeps the fused-kernel rule."""
    from lowbit.kv.plan import resolve

    cfg = tiny_config("smollm2-135m", num_layers=3)
    geo = ModelGeometry.from_config(cfg, name="tiny")
    fed: dict = {}
    errs = {}
    for grid in ("std", "mse"):
        s = parse_kv_scheme("int2", zero="none", grid=grid, sink=4, recent=8, page=4, rotation="none",
                            layer_bits="1=k4v2")
        gen = torch.Generator().manual_seed(7)  # the same K/V for both grids
        cache = QuantizedKVCache(cfg, s, geometry=geo)
        for c in (13, 1, 1, 29):
            for g in geo.layers:
                k = torch.randn(1, g.num_kv_heads, c, g.head_dim_k, generator=gen)
                v = torch.randn(1, g.num_kv_heads, c, g.head_dim_v, generator=gen) * 3
                fed.setdefault((grid, g.index), []).append((k, v))
                cache.layers[g.index].update(k, v)
        e = []
        for g in geo.layers:
            layer = cache.layers[g.index]
            k_all = torch.cat([kv[0] for kv in fed[(grid, g.index)]], -2)
            v_all = torch.cat([kv[1] for kv in fed[(grid, g.index)]], -2)
            lo, n = layer.mid_lo, layer.mid_len
            assert n > 0
            kh, vh = layer.middle_dequantized()
            e.append(float((kh.float() - k_all[:, :, lo:lo + n]).pow(2).sum()
                           + (vh.float() - v_all[:, :, lo:lo + n]).pow(2).sum()))
        errs[grid] = e
        plan = resolve(s, geo)
        assert all(not lp.k.stores_zero and lp.k.tq.grid == grid for lp in plan.layers)
    assert all(m <= s_ * (1 + 1e-6) for m, s_ in zip(errs["mse"], errs["std"]))
    assert sum(errs["mse"]) < sum(errs["std"])


def test_fused_kernel_rule_takes_the_mse_grid():
    """The fused decode kernel takes the mse grid as it takes std scale-only groups (head_dim 64, int2)."""
    from lowbit.kv.capabilities import supports
    from lowbit.kv.plan import resolve

    cfg = tiny_config("smollm2-135m", num_layers=2)
    geo = ModelGeometry.from_config(cfg, name="tiny")
    for lp_m, lp_s in zip(resolve(parse_kv_scheme("int2", zero="none", grid="mse"), geo).layers,
                          resolve(parse_kv_scheme("int2", zero="none"), geo).layers):
        assert supports(lp_m, "decode", "cuda") is None and supports(lp_s, "decode", "cuda") is None


# ------------------------------------------------------------------ tune
def test_tune_offers_the_scale_only_mse_base():
    from lowbit.eval import tune

    b = tune.base_scheme("hadamard", "scale-only-mse")
    assert b.k == TensorQuant(bits=2, grid="mse", zero="none") and b.v == b.k
    assert tune.family("scale-only-mse", 4) == "scale-only-mse" and tune.family("std", 4) == "minmax"
    w = tune.with_layer_bits(b, {0: (4, 2), 1: (2, 2)})
    assert w.for_layer(0).k == TensorQuant(bits=4, grid="mse", zero="none")
    with pytest.raises(LowbitError, match="unknown"):
        tune.base_scheme("hadamard", "mse")
