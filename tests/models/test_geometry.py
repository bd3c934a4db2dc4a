"""Geometry of the built-ins from their stored real configs, and refusals of unsupported configs."""

import pytest

from lowbit.core.errors import LowbitError
from lowbit.models import BUILTINS, ModelGeometry


def _geom(name):
    return ModelGeometry.from_config(BUILTINS[name].config_dict(), name=name)


def test_gemma3_270m_geometry():
    g = _geom("gemma3-270m")
    assert g.num_layers == 18 and g.model_type == "gemma3_text"
    assert g.full_layers == [5, 11, 17]
    assert len(g.sliding_layers) == 15
    for layer in g.layers:
        assert (layer.num_q_heads, layer.num_kv_heads, layer.head_dim_k, layer.head_dim_v) == (4, 1, 256, 256)
        assert layer.storage == "mha" and layer.gqa_group == 4
        assert layer.window == (None if layer.attention == "full" else 512)
    assert [layer.index for layer in g.layers] == list(range(18))
    assert g.summary() == "gemma3-270m: 18 layers, 4 q / 1 kv heads, head_dim 256, 15 sliding (window 512) + 3 full"


def test_smollm2_135m_geometry():
    g = _geom("smollm2-135m")
    assert g.num_layers == 30 and g.model_type == "llama"
    assert g.full_layers == list(range(30)) and g.sliding_layers == []
    assert {(x.num_q_heads, x.num_kv_heads, x.head_dim_k, x.head_dim_v, x.window) for x in g.layers} == {
        (9, 3, 64, 64, None)
    }
    assert g.summary() == "smollm2-135m: 30 layers, 9 q / 3 kv heads, head_dim 64, 30 full"
    assert g.layer_lines() == ["layers 0-29: full, 9q/3kv, d64, mha"]


def test_roundtrip_dict():
    g = _geom("gemma3-270m")
    assert ModelGeometry.from_dict(g.to_dict()) == g


def _cfg(**kw):
    base = {"model_type": "toy", "num_hidden_layers": 3, "num_attention_heads": 6, "hidden_size": 66}
    base.update(kw)
    return base


def test_fallbacks_head_dim_and_kv_heads():
    g = ModelGeometry.from_config(_cfg())
    assert [(x.num_q_heads, x.num_kv_heads, x.head_dim_k, x.attention) for x in g.layers] == [(6, 6, 11, "full")] * 3


def test_sliding_window_without_layer_types_means_all_sliding():
    g = ModelGeometry.from_config(_cfg(num_key_value_heads=2, sliding_window=99))
    assert g.sliding_layers == [0, 1, 2] and {x.window for x in g.layers} == {99}
    g = ModelGeometry.from_config(_cfg(sliding_window=99, use_sliding_window=False))
    assert g.full_layers == [0, 1, 2]


def test_multimodal_text_config_is_used():
    g = ModelGeometry.from_config({"model_type": "mm", "text_config": _cfg(num_key_value_heads=3, head_dim=7)})
    assert g.model_type == "toy" and g.layers[0].head_dim_k == 7 and g.layers[0].num_kv_heads == 3


def test_unsupported_attention_type_is_named():
    cfg = _cfg(layer_types=["full_attention", "linear_attention", "chunked_attention"])
    with pytest.raises(LowbitError, match="chunked_attention, linear_attention not supported"):
        ModelGeometry.from_config(cfg)


@pytest.mark.parametrize(
    "cfg, match",
    [
        (_cfg(layer_types=["full_attention"]), "layer_types has 1 entries"),
        (_cfg(kv_lora_rank=512), "latent attention"),
        (_cfg(num_key_value_heads=4), "not a multiple"),
        (_cfg(hidden_size=67), "not divisible"),
        (_cfg(layer_types=["sliding_attention"] * 3), "no sliding_window"),
        ({"model_type": "gpt2", "n_layer": 12}, "num_hidden_layers"),
    ],
)
def test_bad_configs_raise(cfg, match):
    with pytest.raises(LowbitError, match=match):
        ModelGeometry.from_config(cfg)


def test_accepts_transformers_config():
    from transformers import AutoConfig

    d = BUILTINS["gemma3-270m"].config_dict()
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    assert ModelGeometry.from_config(cfg, name="x").layers == _geom("gemma3-270m").layers
