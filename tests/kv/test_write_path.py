"""Every write path goes through the one quantizer (TensorCodec.encode) and the one ingest (rotation).

Paths exercised per model: a prefill chunk large enough to flush pages, decode steps that fill
and flush pages, a later multi-token chunk, and (gemma3, window 11) sliding eviction of sink,
middle pages and ring rows.
"""

import pytest
import torch

from lowbit.kv.codec import TensorCodec
from lowbit.kv.layer import QuantizedKVLayer
from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import FAST, fast_model, run_chunks, scheme

CHUNKS = [15] + [1] * 9 + [6, 1, 1]
SENTINEL = 7.0


@pytest.fixture(scope="module", params=list(FAST))
def model(request):
    return fast_model(request.param)


def _scheme(name="int4"):
    # tiers small enough that sliding layers (window 11) also flush pages into the middle
    return scheme(name, sink=2, recent=4, page=2, rotation="hadamard")


def _feed(model, cache):
    ids = tiny_tokenizer_free_inputs(model.config, 2, sum(CHUNKS), seed=5)
    return run_chunks(model, cache, ids, None, CHUNKS)


def test_every_middle_row_was_encoded(model, monkeypatch):
    """Poison the quantizer: rows it encodes become the constant SENTINEL. Afterwards every row of
    every middle tier (full and sliding layers) must decode to SENTINEL: none bypassed encode."""
    calls = []
    orig = TensorCodec.encode

    def poisoned(self, x, dense_dtype):
        calls.append(x.shape[-2])
        return orig(self, torch.full_like(x, SENTINEL), dense_dtype)

    monkeypatch.setattr(TensorCodec, "encode", poisoned)
    for name in ("int4", "bf16"):  # the 16-bit middle goes through encode as well
        calls.clear()
        cache = QuantizedKVCache(model, _scheme(name))
        _feed(model, cache)
        checked = 0
        for layer in cache.layers:
            k, v = layer.middle_dequantized()
            if layer.mid_len:
                assert torch.all(k == SENTINEL) and torch.all(v == SENTINEL)
                checked += 1
            # nothing else holds the sentinel: sink and ring were written without the quantizer
            assert not torch.any(layer.sink["k"][:, :, : layer.sink_len] == SENTINEL)
            assert not torch.any(layer.ring["k"][:, :, : layer.ring_len] == SENTINEL)
        assert checked == len(cache.layers)  # every layer had a middle (sliding ones too)
        assert len(calls) >= 2 * len(cache.layers)  # several flushes (prefill, decode, chunk)


def test_rows_counted_equal_rows_that_entered_the_middle(model, monkeypatch):
    """Rows encoded per layer = rows held in the middle + rows evicted from it (sliding)."""
    encoded = {}
    orig = TensorCodec.encode

    def counting(self, x, dense_dtype):
        encoded[id(self)] = encoded.get(id(self), 0) + x.shape[-2]
        return orig(self, x, dense_dtype)

    monkeypatch.setattr(TensorCodec, "encode", counting)
    cache = QuantizedKVCache(model, _scheme("int4"))
    _feed(model, cache)
    n = sum(CHUNKS)
    for layer in cache.layers:
        rows = encoded[id(layer.k_codec)]
        assert rows == encoded[id(layer.v_codec)]
        B, H = layer.B, layer.geometry.num_kv_heads
        assert layer.quantized_rows_total == 2 * B * H * rows
        if layer.window is None:
            # full layer: every slot is in exactly one tier
            assert layer.sink_len + layer.mid_len + layer.ring_len == n
            assert rows == layer.mid_len
        else:
            assert rows > layer.mid_len  # pages were evicted from the sliding middle
            assert rows == layer.mid_lo + layer.mid_len - layer.S  # every slot from S up to the ring was encoded
    assert cache.quantized_rows_total() == sum(layer.quantized_rows_total for layer in cache.layers)


def test_every_stored_token_was_ingested(model, monkeypatch):
    """Poison the ingest (where rotation happens): every tier must hold only poisoned rows."""
    orig = QuantizedKVLayer._ingest

    def poisoned(self, k, v):
        k, v = orig(self, k, v)
        return torch.full_like(k, -3.0), torch.full_like(v, -3.0)

    monkeypatch.setattr(QuantizedKVLayer, "_ingest", poisoned)
    cache = QuantizedKVCache(model, _scheme("bf16"))
    _feed(model, cache)
    for layer in cache.layers:
        k, v = layer.middle_dequantized()
        for t in (layer.sink["k"][:, :, : layer.sink_len], layer.ring["v"][:, :, : layer.ring_len], k, v):
            assert torch.all(t == -3.0)


def test_stored_keys_are_rotated_in_every_tier(model):
    """With Hadamard rotation and a 16-bit middle, sink/middle/ring hold k @ H exactly."""
    from lowbit.rotation.hadamard import hadamard

    captured = {}
    orig = QuantizedKVLayer.update

    def spy(self, k, v, *a, **kw):
        captured.setdefault(self.layer_idx, []).append(k.detach().clone())
        return orig(self, k, v, *a, **kw)

    QuantizedKVLayer.update = spy
    try:
        cache = QuantizedKVCache(model, _scheme("bf16"))
        _feed(model, cache)
    finally:
        QuantizedKVLayer.update = orig
    layer = cache.layers[-1]  # a full layer in both models
    assert layer.window is None
    k_all = torch.cat(captured[layer.layer_idx], dim=2) @ hadamard(layer.geometry.head_dim_k)
    mid_k, _ = layer.middle_dequantized()
    held = torch.cat([layer.sink["k"][:, :, : layer.sink_len], mid_k, layer.ring["k"][:, :, : layer.ring_len]], 2)
    torch.testing.assert_close(held, k_all, rtol=1e-5, atol=1e-5)
