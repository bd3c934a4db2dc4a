"""With quantization off, every tier arrangement gives DynamicCache's logits (1e-4 relative)."""

import pytest
import torch
from transformers import DynamicCache

from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import FAST, fast_model, reference, rel_err, run_chunks, scheme

TOL = 1e-4


@pytest.fixture(scope="module", params=list(FAST))
def model(request):
    return fast_model(request.param)


def _ids(model, B=1, L=29, seed=0):
    return tiny_tokenizer_free_inputs(model.config, B, L, seed=seed)


@pytest.mark.parametrize("tiers", [{"sink": 4, "recent": 8, "page": 4}, {"sink": 0, "recent": 4, "page": 2}, {"sink": 8, "recent": 0, "page": 8}])
def test_prefill_then_decode(model, tiers):
    ids = _ids(model)
    chunks = [17] + [1] * 12
    ref = reference(model, ids, None, chunks)
    out = run_chunks(model, QuantizedKVCache(model, scheme("bf16", **tiers)), ids, None, chunks)
    assert rel_err(out, ref) < TOL


def test_chunked_feeding(model):
    ids = _ids(model, L=31)
    chunks = [5, 1, 9, 3, 1, 12]
    ref = reference(model, ids, None, chunks)
    cache = QuantizedKVCache(model, scheme("bf16"))
    out = run_chunks(model, cache, ids, None, chunks)
    assert rel_err(out, ref) < TOL
    full = [g.index for g in cache.geometry.layers if g.attention == "full"]
    assert cache.layers[full[0]].mid_len > 0  # the middle tier was really used


def test_left_padded_batch_of_three(model):
    ids = _ids(model, B=3, L=27, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :13] = 0  # longer than the sink + a page: padding reaches the middle tier
    for chunks in ([27], [9, 1, 1, 16]):
        ref = reference(model, ids, mask, chunks)
        out = run_chunks(model, QuantizedKVCache(model, scheme("bf16")), ids, mask, chunks)
        assert rel_err(out, ref, mask) < TOL


def test_generate_left_padded_matches_dynamic_cache(model):
    ids = _ids(model, B=3, L=19, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :7] = 0
    kw = {"attention_mask": mask, "max_new_tokens": 9, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    cache = QuantizedKVCache(model, scheme("bf16"))
    out = model.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(out.scores, ref.scores):
        assert rel_err(a, b) < TOL
    assert cache.get_seq_length() == 19 + 8  # the last sampled token is never fed back


def test_int8_within_one_percent(model):
    ids = _ids(model, L=33)
    chunks = [20] + [1] * 13
    ref = reference(model, ids, None, chunks)
    cache = QuantizedKVCache(model, scheme("int8"))
    out = run_chunks(model, cache, ids, None, chunks)
    assert cache.quantized_rows_total() > 0
    err = float((out - ref).norm() / ref.norm())
    assert 0 < err < 0.01


def test_lowbit_attention_is_exact_without_lowbit_cache(model):
    """A model switched to 'lowbit' stays exact with DynamicCache (padding and sliding included)."""
    ids = _ids(model, B=2, L=21, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    chunks = [13, 1, 7]
    ref = reference(model, ids, mask, chunks)
    QuantizedKVCache(model, scheme("bf16"))  # installs "lowbit"
    out = run_chunks(model, DynamicCache(config=model.config), ids, mask, chunks)
    assert model.config._attn_implementation == "lowbit"
    assert rel_err(out, ref, mask) < TOL
