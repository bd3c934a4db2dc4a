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

from lowbit.kv import QuantizedKVCache
from lowbit.kv.cache import cache_kwargs
from lowbit.models.families import tiny_overrides
from lowbit.models.tiny import tiny_model

from .helpers import rel_err, scheme

_IDS = tiny_overrides("qwen2.5-vl-7b")
IMAGE, V_START, V_END = _IDS["image_token_id"], _IDS["vision_start_token_id"], _IDS["vision_end_token_id"]


@pytest.fixture(scope="module")
def vlm():
    m, _ = tiny_model("qwen2.5-vl-7b", seed=0)
    return m


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 4, 6]])  # 24 patches -> 6 image tokens after the 2x2 merge
    pix = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=g)
    text = torch.randint(10, 90, (19,), generator=g).tolist()
    ids = torch.tensor([[5, 6, V_START] + [IMAGE] * 6 + [V_END] + text])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pix, "image_grid_thw": grid}


@torch.no_grad()
def _generate(model, cache, n=32):
    kw = dict(max_new_tokens=n, do_sample=False, return_dict_in_generate=True, output_scores=True)
    return model.generate(**_inputs(), **kw, **cache_kwargs(model, cache))


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
