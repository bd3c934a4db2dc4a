"""lowbit.kv.held: held bits computed from the plan at context N equal what a real cache holds after N
tokens (tier lengths and bytes), sliding layers weigh what they hold, codebooks and containers count."""

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.held import held_bits, held_bits_of_cache, tier_tokens
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models import ModelGeometry
from lowbit.models.tiny import tiny_config
from lowbit.runtime.cache import QuantizedKVCache


def _geometry(name="gemma3-270m", layers=6):
    cfg = tiny_config(name, num_layers=layers)
    return cfg, ModelGeometry.from_config(cfg, name="tiny")


def _fill(cache, geometry, n, chunk, seed=0):
    """Feed n random tokens `chunk` at a time straight into every layer's tiers (no model)."""
    gen = torch.Generator().manual_seed(seed)
    fed = 0
    while fed < n:
        c = min(chunk, n - fed)
        for g in geometry.layers:
            k = torch.randn(1, g.num_kv_heads, c, g.head_dim_k, generator=gen)
            v = torch.randn(1, g.num_kv_heads, c, g.head_dim_v, generator=gen)
            cache.layers[g.index].update(k, v)
        fed += c


@pytest.mark.parametrize("name,flags,n,chunk", [
    ("int2", {"sink": 16, "recent": 32, "layer_bits": "5=k4v8"}, 560, 40),    # sliding layers past their window
    ("int2", {"sink": 16, "recent": 32, "layer_bits": "1=int8;5=k4v8"}, 1001, 91),
    ("int3", {"sink": 0, "recent": 16}, 99, 128),                             # one chunk, 4-bit containers
    ("kivi2", {}, 613, 61),                                                  # channel-axis keys: scale per page
    ("int2", {"sink": 16, "recent": 16, "lloyd_max": True}, 555, 111),         # codebooks amortised
])
def test_held_bits_of_the_plan_equal_the_cache_after_n_tokens(name, flags, n, chunk):
    cfg, geo = _geometry()
    s = parse_kv_scheme(name, **flags)
    cache = QuantizedKVCache(cfg, s, geometry=geo)
    _fill(cache, geo, n, chunk)
    plan, live = held_bits(s, n, geometry=geo, chunk=chunk), held_bits_of_cache(cache)
    assert [lh.tokens for lh in plan.layers] == [lh.tokens for lh in live.layers]
    assert plan.bits == pytest.approx(live.bits, rel=1e-12) and plan.k_bits == pytest.approx(live.k_bits, rel=1e-12)
    # the cache's own MemoryReport (codes + fp16 scale/zero) agrees; codebooks come on top, amortised
    bk, bv = cache.memory().middle_bits_per_element()
    ek = plan._sum("elements_k")
    cb_k = 32 * (1 << s.k.bits) * sum(1 for lh in plan.layers if lh.elements_k) if s.k.lloyd_max else 0
    assert plan.k_bits == pytest.approx(bk + cb_k / ek, rel=1e-9) and bv is not None

def test_sliding_layers_hold_at_most_their_window_and_full_layers_weigh_what_they_hold():
    _, geo = _geometry("gemma3-270m", layers=6)  # layers 0-4 sliding (512), 5 full
    s = parse_kv_scheme("int2", layer_bits="5=int8")
    h = held_bits(s, 32768, geometry=geo)
    for lh in h.layers:
        held = sum(lh.tokens.values())
        assert held <= (512 + s.page if lh.window else 32768)
    w = h.weights()
    assert w[5] > 0.9 and sum(w.values()) == pytest.approx(1.0)
    # the average is weighted by what is held: near int8's 8.25 b, far from a mean over layers
    k2 = s.k.bits_per_element(256)
    assert h.bits == pytest.approx(sum(w[i] * (8.25 if i == 5 else k2) for i in w), rel=1e-9)
    assert h.bits > 7.5 > (5 * k2 + 8.25) / 6
    d = h.dense()
    assert d["sink_tokens"] == 64 and d["recent_tokens"] >= 6 * 256 and 0 < d["dense_share"] < 0.1


def test_short_context_holds_no_middle_and_bad_context():
    _, geo = _geometry("smollm2-135m", layers=3)
    h = held_bits(parse_kv_scheme("int2"), 300, geometry=geo)
    assert h.bits is None and "nothing quantized" in h.line()
    assert tier_tokens(300, 64, 256, 16, None) == (64, 0, 236)
    assert tier_tokens(336, 64, 256, 16, None) == (64, 16, 256)
    with pytest.raises(LowbitError, match="context must be"):
        held_bits(parse_kv_scheme("int2"), 0, geometry=geo)
