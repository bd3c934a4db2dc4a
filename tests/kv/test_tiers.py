"""Tier bookkeeping, sliding windows, buffer growth, memory accounting, streaming, errors."""

import itertools

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import fast_model, make_model, reference, rel_err, run_chunks, scheme


@pytest.fixture(scope="module")
def llama():
    return make_model("smollm2-135m", num_layers=1)


@pytest.fixture(scope="module")
def gemma():
    return fast_model("gemma3-270m")  # layer 0 sliding (window 11), layer 1 full


def _ids(model, B, L, seed=0):
    return tiny_tokenizer_free_inputs(model.config, B, L, seed=seed)


def test_full_layer_tiers(llama):
    cache = QuantizedKVCache(llama, scheme("int4", sink=4, recent=8, page=4))
    ids = _ids(llama, 1, 40)
    run_chunks(llama, cache, ids, None, [3, 7, 1, 1, 13] + [1] * 15)
    lay = cache.layers[0]
    assert (lay.sink_len, lay.n) == (4, 40)
    assert lay.mid_len % 4 == 0 and 8 <= lay.ring_len < 12
    assert lay.sink_len + lay.mid_len + lay.ring_len == 40
    assert lay.mid_lo == 4 and lay.n - lay.ring_len == 4 + lay.mid_len


def test_sliding_layer_holds_only_its_window(gemma):
    cache = QuantizedKVCache(gemma, scheme("int4", sink=2, recent=4, page=2))
    ids = _ids(gemma, 1, 40)
    W = 11
    for t in range(40):
        run_chunks(gemma, cache, ids[:, t : t + 1], None, [1])
        s = cache.layers[0]
        held = s.sink_len + s.mid_len + s.ring_len
        assert held <= W + s.page - 1  # the window (W-1 + this token) plus at most a page of slack
        first = 0 if s.sink_len else s.mid_lo if s.mid_len else s.n - s.ring_len
        assert first >= s.n - W - (s.page - 1)
    assert cache.layers[0].quantized_rows_total > 0
    assert cache.layers[1].sink_len + cache.layers[1].mid_len + cache.layers[1].ring_len == 40


def test_sliding_chunk_sees_window_plus_chunk(gemma):
    """A 12-token chunk after 20 tokens: its first query needs 10 keys from before the chunk."""
    ids = _ids(gemma, 2, 32, seed=4)
    chunks = [20, 12]
    ref = reference(gemma, ids, None, chunks)
    out = run_chunks(gemma, QuantizedKVCache(gemma, scheme("bf16", sink=2, recent=2, page=2)), ids, None, chunks)
    assert rel_err(out, ref) < 1e-4


def test_middle_capacity_grows_by_doubling(llama):
    """Fed token by token (the layer API, no model), the middle buffer only ever doubles."""
    cache = QuantizedKVCache(llama, scheme("int2", sink=0, recent=4, page=4))
    lay = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    caps = []
    for _ in range(700):
        kv = torch.randn(1, 3, 1, 64, generator=g)
        lay.update(kv, kv)
        caps.append(lay.mid_cap)
    grows = [c for a, c in itertools.pairwise(caps) if c != a]
    assert len(grows) >= 2
    for a, c in zip([caps[0]] + grows, grows):
        assert c >= 2 * a
    assert lay.mid_len == 700 - lay.ring_len and lay.mid_cap >= lay.mid_len
    assert lay.mid["k"]["codes"].shape[2] == lay.mid_cap  # preallocated rows, not the live ones


@pytest.mark.parametrize(
    "name,group,bits,limit",
    [("gemma3-270m", None, 2.25, 2.3), ("smollm2-135m", 64, 2.5, 2.5)],
)
def test_int2_middle_bits_per_element(name, group, bits, limit):
    """Measured from the held tensors: codes + fp16 scale/zero per group, K and V."""
    model = fast_model(name) if name.startswith("gemma") else make_model(name, num_layers=1)
    kw = {"group": group} if group else {}
    cache = QuantizedKVCache(model, scheme("int2", sink=4, recent=8, page=4, **kw))
    run_chunks(model, cache, _ids(model, 2, 37), None, [30, 1, 1, 5])
    mem = cache.memory()
    bk, bv = mem.middle_bits_per_element()
    assert bk == pytest.approx(bits) and bv == pytest.approx(bits)
    assert bk / 16 <= limit / 16 and bv / 16 <= limit / 16
    assert cache.scheme.bits_per_element(cache.geometry.layers[0].head_dim_k) == (pytest.approx(bits),) * 2
    line = cache.summary()
    assert f"middle K {bits:.2f} / V {bits:.2f} bits/elt" in line
    assert f"{mem.quantized_tokens()} quantized per full layer" in line and mem.quantized_tokens() > 0
    assert mem.quantized_rows() > 0 and cache.quantized_rows_total() >= mem.quantized_rows()
    # live bytes add up per tier; nothing counted twice
    assert mem.live_bytes == mem.total("sink") + mem.total("middle") + mem.total("recent")
    assert mem.allocated_bytes >= mem.live_bytes


@pytest.mark.parametrize("name,expect", [("kivi2", 3.0), ("int3", 4.5), ("int8", 8.5)])
def test_other_schemes_bits(llama, name, expect):
    s = scheme(name, sink=0, recent=32, page=32) if name.startswith("kivi") else scheme(name)
    cache = QuantizedKVCache(llama, s)
    run_chunks(llama, cache, _ids(llama, 1, 70), None, [60] + [1] * 10)
    bk, bv = cache.memory().middle_bits_per_element()
    assert bk == pytest.approx(expect)
    assert bv == pytest.approx(expect)  # kivi2 V: per token, group 32 -> 2 + 32/32


def test_streamed_middle_blocks_give_the_same_logits(llama):
    """Decoding the middle 4 rows at a time (many online-softmax merges) = one block."""
    ids = _ids(llama, 2, 45, seed=3)
    chunks = [30] + [1] * 15
    a = run_chunks(llama, QuantizedKVCache(llama, scheme("int4"), chunk_tokens=4), ids, None, chunks)
    b = run_chunks(llama, QuantizedKVCache(llama, scheme("int4"), chunk_tokens=1024), ids, None, chunks)
    assert rel_err(a, b) < 1e-5


def test_lloyd_max_int2_beats_uniform_on_gaussian_rows_and_runs_in_the_cache(llama):
    from lowbit.kv.codec import TensorCodec

    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    lm = TensorCodec(scheme("int2", lloyd_max=True).k, 64, 4)
    uni = TensorCodec(scheme("int2", grid="minmax").k, 64, 4)
    e_lm = (lm.decode(lm.encode(x, torch.float32)) - x).pow(2).mean()
    e_uni = (uni.decode(uni.encode(x, torch.float32)) - x).pow(2).mean()
    assert e_lm < 0.8 * e_uni
    ids = _ids(llama, 1, 30)
    ref = reference(llama, ids, None, [25] + [1] * 5)
    cache = QuantizedKVCache(llama, scheme("int2", lloyd_max=True))
    out = run_chunks(llama, cache, ids, None, [25] + [1] * 5)
    assert cache.quantized_rows_total() > 0 and 0 < rel_err(out, ref) < 1


# ------------------------------------------------------------------ errors
def test_errors_at_use(llama):
    ids = _ids(llama, 2, 9)
    cache = QuantizedKVCache(llama, scheme("int4"))
    with pytest.raises(LowbitError, match="attention_mask covers"):
        llama(ids, attention_mask=torch.ones(2, 4, dtype=torch.long), past_key_values=cache)
    cache = QuantizedKVCache(llama, scheme("int4"))
    run_chunks(llama, cache, ids, None, [9])
    with pytest.raises(LowbitError, match="batch size changed"):
        run_chunks(llama, cache, ids[:1, :1], None, [1])


def test_cache_without_lowbit_attention_is_refused(llama):
    """A cache built from the config only, on a model still using SDPA, must not silently mis-attend."""
    cache = QuantizedKVCache(llama.config, scheme("int4"))
    llama.set_attn_implementation("sdpa")
    ids = _ids(llama, 1, 5)
    with pytest.raises(LowbitError, match="not using the 'lowbit' attention"):
        llama(ids, past_key_values=cache)
        llama(ids[:, :1], past_key_values=cache)


def test_a_chunk_attends_to_itself_exactly_and_to_history_as_stored(llama):
    """int2, 24-token prefill: its logits are the bf16 ones (its own K/V arrive exact) although
    12 of its tokens were stored quantized; the next chunk reads them quantized."""
    ids = _ids(llama, 2, 34, seed=9)
    ref = reference(llama, ids, None, [24, 10])
    cache = QuantizedKVCache(llama, scheme("int2", sink=4, recent=8, page=4))
    out = run_chunks(llama, cache, ids, None, [24, 10])
    assert cache.layers[0].mid_len >= 12
    assert rel_err(out[:, :24], ref[:, :24]) < 1e-4
    assert rel_err(out[:, 24:], ref[:, 24:]) > 1e-2


def test_beam_search_reorders_every_tier(llama):
    """generate(num_beams=3) repeats and reorders the batch of every tier: bf16 tiers = DynamicCache."""
    from transformers import DynamicCache

    ids = _ids(llama, 2, 15)
    kw = {"max_new_tokens": 10, "do_sample": False, "num_beams": 3, "attention_mask": torch.ones_like(ids)}
    llama.set_attn_implementation("sdpa")
    a = llama.generate(ids, past_key_values=DynamicCache(config=llama.config), **kw)
    b = llama.generate(ids, past_key_values=QuantizedKVCache(llama, scheme("bf16")), **kw)
    assert torch.equal(a, b)
