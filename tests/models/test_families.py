"""Geometry of the stored family configs (DeepSeek-V3, Kimi-K2, Gemma-4 text), per layer."""

import pytest

from lowbit.core.errors import LowbitError
from lowbit.models.families import FAMILIES, family_config_dict, family_geometry
from lowbit.models.geometry import ModelGeometry


def _hf(name):
    from transformers import AutoConfig

    d = family_config_dict(name)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def test_deepseek_v3_latent_and_expanded():
    lat = family_geometry("deepseek-v3")
    g = lat.layers[0]
    assert lat.num_layers == 61 and len(lat.groups()) == 1
    assert (g.storage, g.num_q_heads, g.num_kv_heads, g.head_dim_k, g.head_dim_v) == ("mla-latent", 128, 1, 576, 512)
    assert g.k_own_dims() == list(range(512, 576)) and g.shares_kv
    exp = family_geometry("deepseek-v3", mla="expanded").layers[0]
    assert (exp.storage, exp.num_kv_heads, exp.head_dim_k, exp.head_dim_v, exp.shares_kv) == ("mha", 128, 192, 128, False)
    kimi = family_geometry("kimi-k2", mla="expanded").layers[0]
    assert (kimi.num_q_heads, kimi.head_dim_k, kimi.head_dim_v) == (64, 192, 128)
    with pytest.raises(LowbitError, match="mla="):
        ModelGeometry.from_config(family_config_dict("deepseek-v3"), mla="packed")


def test_gemma4_per_layer_from_hub_keys_and_transformers_config():
    g = family_geometry("gemma4-text")
    assert g.full_layers == [5, 11, 17, 23, 29]
    full, slide = g.layers[5], g.layers[0]
    assert (full.num_kv_heads, full.head_dim_k, full.k_eq_v, full.rope_dim) == (1, 512, True, 128)
    assert full.k_own_dims() == list(range(64)) + list(range(256, 320))  # rotate_half pairs i, i + 256
    assert (slide.num_kv_heads, slide.head_dim_k, slide.k_eq_v, slide.window) == (8, 256, False, 1024)
    # transformers 5.24 turns the hub keys into per_layer_config ("05": {...}); same geometry either way
    assert ModelGeometry.from_config(_hf("gemma4-text"), name="gemma4-text") == g
    assert ModelGeometry.from_dict(g.to_dict()) == g


def test_gemma4_shared_kv_layers_are_named_and_refused_by_the_plan():
    from lowbit.kv.plan import resolve

    d = family_config_dict("gemma4-text")
    d["num_kv_shared_layers"] = 12
    g = ModelGeometry.from_config(d)
    assert g.layers[17].kv_shared_from is None  # before the first consumer (30 - 12 = 18)
    assert g.layers[18].kv_shared_from == 16 and g.layers[23].kv_shared_from == 17 and g.layers[29].kv_shared_from == 17
    with pytest.raises(LowbitError, match="num_kv_shared_layers"):
        resolve("int4", g)


def test_shared_kv_layers_decode_on_the_latent_kernel_with_the_reason():
    from lowbit.kv.plan import resolve

    plan = resolve("int2", family_geometry("deepseek-v3"), device="cuda")
    assert plan.layers[0].backends["decode"].name == "triton-decode"
    assert "latent" in plan.layers[0].backends["decode"].reason
    assert resolve("int2", family_geometry("deepseek-v3"), device="cpu").layers[0].backends["decode"].name != "triton-decode"
    assert plan.layers[0].k.bits == 16 and plan.layers[0].k.head_dim == 64 and plan.layers[0].rot_k is None
    assert plan.layers[0].v.bits == 2 and plan.layers[0].v.group == 128 and plan.layers[0].rot_v.shape == (512, 512)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_builds_a_tiny_model(name):
    from lowbit.models.tiny import tiny_config

    cfg = tiny_config(name, vocab_size=99)
    full = family_geometry(name)
    tiny = ModelGeometry.from_config(cfg)
    assert {x.group_key for x in tiny.layers} == {x.group_key for x in full.layers}  # same attention geometry
    assert {(x.head_dim_k, x.head_dim_v) for x in tiny.layers} == {(x.head_dim_k, x.head_dim_v) for x in full.layers}
