"""Qwen2.5-VL: generate with an image through the lowbit cache (M-RoPE 3-D positions, image tokens in the tiers).

A tiny random Qwen2_5_VLForConditionalGeneration from the shipped qwen2.5-vl-7b config (lowbit.models.families):
head_dim 128 with M-RoPE sections [16, 24, 24] (temporal / height / width), GQA 8 q / 4 kv heads (the real 4 KV heads),
the real prompt layout <vision_start> <image> x N <vision_end>; a 2-block vision tower with the real patch
geometry. The cache holds post-RoPE keys, so the 3-D positions only have to reach transformers' rotary code unchanged; the reference is the same generate call
with DynamicCache. The vision tower keeps its own attention (it packs images by cu_seqlens).
"""

import pytest
import torch
from transformers import DynamicCache

from lowbit.models.families import tiny_overrides
from lowbit.models.tiny import tiny_model
from lowbit.runtime.cache import QuantizedKVCache, cache_kwargs

from .helpers import rel_err, scheme

_IDS = tiny_overrides("qwen2.5-vl-7b")
IMAGE, V_START, V_END = _IDS["image_token_id"], _IDS["vision_start_token_id"], _IDS["vision_end_token_id"]


@pytest.fixture(scope="module")
def vlm():
    m, _ = tiny_model("qwen2.5-vl-7b", seed=0)
    return m


def _inputs(seed=0, before=2, after=19, image_tokens=6):
    """`before` text tokens, <vision_start> <image> x image_tokens <vision_end>, `after` text tokens; one 4x6-patch
    image (24 patches -> 6 image tokens after the 2x2 merge)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 4, 6]])
    pix = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=g)
    text = torch.randint(10, 90, (after,), generator=g).tolist()
    head = ([5, 6] + list(range(20, 20 + before)))[:before]
    ids = torch.tensor([head + [V_START] + [IMAGE] * image_tokens + [V_END] + text])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pix, "image_grid_thw": grid}


@torch.no_grad()
def _generate(model, cache, n=32, **layout):
    kw = dict(max_new_tokens=n, do_sample=False, return_dict_in_generate=True, output_scores=True)
    return model.generate(**_inputs(**layout), **kw, **cache_kwargs(model, cache))


def test_generate_with_image_equals_dynamic_cache(vlm):
    ref = _generate(vlm, DynamicCache(config=vlm.config))
    cache = QuantizedKVCache(vlm, scheme("bf16", sink=2, recent=4, page=2))
    out = _generate(vlm, cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert max(rel_err(a, b) for a, b in zip(out.scores, ref.scores)) < 1e-4
    assert vlm.model.visual.config._attn_implementation == "sdpa"  # the tower kept its attention
    layer = cache.layers[0]
    assert layer.mid_lo <= 3 and layer.mid_len > 10  # the image tokens (slots 3..8) sit in the middle tier


def test_int8_with_image_close(vlm):
    ref = _generate(vlm, DynamicCache(config=vlm.config), n=16)
    cache = QuantizedKVCache(vlm, scheme("int8", sink=2, recent=4, page=2))
    out = _generate(vlm, cache, n=16)
    assert cache.quantized_rows_total() > 0
    err = max(float((a - b).norm() / b.norm()) for a, b in zip(out.scores, ref.scores))
    assert 0 < err < 0.01


@pytest.mark.parametrize("before, after", [(0, 9), (1, 9), (9, 0)], ids=["sink", "sink-middle", "recent"])
def test_any_image_placement_in_the_tiers_is_exact(vlm, before, after):
    """The cache holds post-RoPE keys per slot, so where the image sits (from slot 0 in the sink, across the
    sink / middle edge and page edges, or last, in the recent window at prefill) changes nothing at bf16."""
    ref = _generate(vlm, DynamicCache(config=vlm.config), n=12, before=before, after=after)
    cache = QuantizedKVCache(vlm, scheme("bf16", sink=2, recent=4, page=2))
    out = _generate(vlm, cache, n=12, before=before, after=after)
    assert torch.equal(out.sequences, ref.sequences)
    assert max(rel_err(a, b) for a, b in zip(out.scores, ref.scores)) < 1e-4


def test_image_tokens_that_do_not_match_the_grid_are_refused_before_the_cache(vlm):
    """5 image tokens for an image whose grid gives 6 features: transformers refuses it (ValueError) while merging
    the image features, before any decoder layer runs, so the cache holds nothing (no half-written prompt)."""
    cache = QuantizedKVCache(vlm, scheme("bf16", sink=2, recent=4, page=2))
    with pytest.raises(ValueError, match="do not match"):
        _generate(vlm, cache, n=2, image_tokens=5)
    assert cache.get_seq_length() == 0 and all(layer.n == 0 for layer in cache.layers)
