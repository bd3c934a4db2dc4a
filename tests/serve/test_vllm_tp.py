"""Tensor-parallel slicing of the per-KV-head tensors (lowbit.vllm_plugin.tp): every rank's slice of one
export, put back together over all ranks, is the TP=1 tensor (TP 2/4/8/16 on Llama-3's 32 q / 8 KV heads, 16 replicating each KV head; the built-ins'
own layouts); ranks hold the heads vLLM gives them."""

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.key_affine import KeyAffine
from lowbit.models.geometry import ModelGeometry
from lowbit.models.tiny import tiny_config
from lowbit.rotation.rotation_set import RotationSet
from lowbit.vllm_plugin import tp


def _orthogonal(*shape):
    q, _ = torch.linalg.qr(torch.randn(*shape, dtype=torch.float64))
    return q.float()


@pytest.mark.parametrize("h,p,expect", [(8, 1, [range(8)]), (8, 2, [range(4), range(4, 8)]),
                                        (8, 8, [range(i, i + 1) for i in range(8)]),
                                        (2, 4, [range(1), range(1), range(1, 2), range(1, 2)]),
                                        (1, 8, [range(1)] * 8)])
def test_heads_per_rank_follow_vllms_split(h, p, expect):
    assert [tp.kv_heads_for_rank(h, p, r) for r in range(p)] == expect


@pytest.mark.parametrize("h,p", [(8, 3), (3, 2), (2, 3), (6, 4)])
def test_uneven_split_is_refused_in_one_line(h, p):
    with pytest.raises(LowbitError, match="tensor-parallel size"):
        tp.kv_heads_for_rank(h, p, 0)


def test_rank_outside_size_is_refused():
    with pytest.raises(LowbitError, match="outside"):
        tp.kv_heads_for_rank(8, 2, 2)


def _geometry(name):
    if name == "llama3-like":  # Llama-3-8B's head layout (32 q / 8 KV heads), tiny widths
        from transformers import LlamaConfig

        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=512, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=64, vocab_size=99)
        return ModelGeometry.from_config(cfg, name=name)
    return ModelGeometry.from_config(tiny_config(name), name=name)


@pytest.mark.parametrize("name,tp_size", [("llama3-like", 2), ("llama3-like", 4), ("llama3-like", 8),
                                          ("llama3-like", 16), ("qwen2.5-coder-0.5b", 2),
                                          ("smollm2-135m", 3)])
def test_rotation_and_key_affine_slices_reassemble(name, tp_size):
    torch.manual_seed(0)
    geo = _geometry(name)
    rs = RotationSet(model=name,
                     k=tuple(_orthogonal(g.num_kv_heads, g.head_dim_k, g.head_dim_k) for g in geo.layers),
                     v=tuple(_orthogonal(g.num_kv_heads, g.head_dim_v, g.head_dim_v) for g in geo.layers))
    maps = {g.index: KeyAffine(torch.rand(g.num_kv_heads, g.head_dim_k) + 0.5, torch.randn(g.num_kv_heads,
                                                                                          g.head_dim_k))
            for g in geo.layers}
    per_rank = [tp.slice_rotation_set(rs, geo, tp_size, r) for r in range(tp_size)]
    ka_rank = [tp.slice_key_affine(maps, geo, tp_size, r) for r in range(tp_size)]
    for g in geo.layers:
        i, h = g.index, g.num_kv_heads
        assert torch.equal(tp.reassemble([p.k[i] for p in per_rank], h, tp_size), rs.k[i])
        assert torch.equal(tp.reassemble([p.v[i] for p in per_rank], h, tp_size), rs.v[i])
        assert torch.equal(tp.reassemble([m[i].scale for m in ka_rank], h, tp_size), maps[i].scale)
        assert torch.equal(tp.reassemble([m[i].shift for m in ka_rank], h, tp_size), maps[i].shift)
        for r in range(tp_size):
            assert per_rank[r].k[i].shape[0] == len(tp.kv_heads_for_rank(h, tp_size, r))
    for r in range(tp_size):
        sub = tp.slice_geometry(geo, tp_size, r)
        per_rank[r].validate_against(sub)  # the rank's rotations fit the rank's view of the model


def test_per_layer_rotations_are_shared_by_every_rank():
    geo = ModelGeometry.from_config(tiny_config("smollm2-135m"), name="smollm2-135m")
    rs = RotationSet(model="smollm2-135m", k=tuple(_orthogonal(g.head_dim_k, g.head_dim_k) for g in geo.layers),
                     v=tuple(_orthogonal(g.head_dim_v, g.head_dim_v) for g in geo.layers))
    assert tp.slice_rotation_set(rs, geo, 4, 3) is rs


def test_a_tensor_without_the_layers_heads_is_refused():
    with pytest.raises(LowbitError, match="export again"):
        tp.slice_heads(torch.zeros(3, 4), num_kv_heads=8, tp_size=2, rank=0)
