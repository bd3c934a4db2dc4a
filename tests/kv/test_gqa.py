"""Query heads read the right KV head: GQA ratios 1, 3, 4 (and MQA) at batch sizes 1, 2, 5."""

import pytest
import torch

from lowbit.backends.torch_stream import online_attention
from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import make_model, reference, rel_err, run_chunks, scheme


@pytest.mark.parametrize("ratio", [1, 3, 4])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_gqa_model_matches_dynamic_cache(ratio, batch):
    """1-layer llama with 2 KV heads and 2*ratio query heads, bf16 tiers, prefill + decode."""
    model = make_model("smollm2-135m", num_layers=1, num_key_value_heads=2, num_attention_heads=2 * ratio, seed=ratio)
    ids = tiny_tokenizer_free_inputs(model.config, batch, 19, seed=batch)
    mask = torch.ones_like(ids)
    mask[-1, : min(6, batch + 2)] = 0  # the last row is left-padded
    chunks = [13, 1, 1, 1, 3]
    ref = reference(model, ids, mask, chunks)
    out = run_chunks(model, QuantizedKVCache(model, scheme("bf16")), ids, mask, chunks)
    assert rel_err(out, ref, mask) < 1e-4


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2), (5, 1)])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_online_attention_head_mapping(hq, hkv, batch):
    """Query head j reads KV head j // (hq / hkv), against an explicit per-head loop; the keys
    arrive in three blocks (as sink / middle / recent do)."""
    g = torch.Generator().manual_seed(hq * 10 + batch)
    D, L, Lq = 16, 23, 3
    q = torch.randn(batch, hq, Lq, D, generator=g)
    k = torch.randn(batch, hkv, L, D, generator=g) * 3  # distinct heads: a wrong mapping shows
    v = torch.randn(batch, hkv, L, D, generator=g)
    G = hq // hkv
    blocks = [(k[:, :, a:b], v[:, :, a:b], a) for a, b in ((0, 4), (4, 15), (15, L))]
    q_slots = torch.arange(L - Lq, L)
    out = online_attention(q.view(batch, hkv, G, Lq, D), blocks, q_slots, scaling=D**-0.5)
    out = out.reshape(batch, hq, Lq, D)
    for b in range(batch):
        for j in range(hq):
            h = j // G
            s = q[b, j] @ k[b, h].T * D**-0.5  # [Lq, L]
            causal = torch.arange(L)[None, :] <= q_slots[:, None]
            p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
            torch.testing.assert_close(out[b, j], p @ v[b, h], rtol=1e-5, atol=1e-5)
