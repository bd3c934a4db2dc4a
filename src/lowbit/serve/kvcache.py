"""The one place the server touches the KV cache: make a cache per request, measure what it holds.

    factory = CacheFactory(model, scheme, geometry)   # checks the scheme against the model once
    cache = factory.new()                              # a fresh cache for one request
    cache_stats(cache) -> CacheStats(bytes_held, tokens, quantized_tokens)

bf16 (K and V unquantized) is served by lowbit.runtime.cache.QuantizedKVCache when it exists (the same code
path as every other scheme) and otherwise by transformers' DynamicCache: both hold the history
unquantized, so reporting "bf16" is true either way. A quantized scheme needs
lowbit.runtime.cache.QuantizedKVCache; without it the server refuses to start rather than serve bf16 while
claiming int2. `served_scheme()` describes what the caches really are, and `/v1/models` and
`/metrics` report it.

Bytes are measured from the tensors the cache holds (every tensor reachable from the cache
object, each storage counted once), so preallocated buffers count as held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.plan import resolve as plan_resolve


@dataclass(frozen=True)
class CacheStats:
    bytes_held: int
    tokens: int
    quantized_tokens: int


def tensor_bytes(obj, _seen_obj=None, _seen_storage=None, _depth=0) -> int:
    """Bytes of every distinct tensor storage reachable from `obj` (attributes, lists, tuples, dicts)."""
    if _seen_obj is None:
        _seen_obj, _seen_storage = set(), set()
    if _depth > 8 or id(obj) in _seen_obj:
        return 0
    _seen_obj.add(id(obj))
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        key = (st.data_ptr(), obj.device.type)
        if key in _seen_storage or st.nbytes() == 0:
            return 0
        _seen_storage.add(key)
        return st.nbytes()
    if isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, (list, tuple, set)):
        children = obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        children = vars(obj).values()
    else:
        return 0
    return sum(tensor_bytes(c, _seen_obj, _seen_storage, _depth + 1) for c in children)


def _quantized_cache_class():
    try:
        from lowbit.runtime.cache import QuantizedKVCache
    except ImportError:
        try:  # the package may not re-export it yet
            from lowbit.runtime.cache import QuantizedKVCache
        except ImportError:
            return None
    return QuantizedKVCache


def cache_stats(cache) -> CacheStats:
    """What one cache holds right now, measured from its tensors.

    quantized_tokens: tokens held in the packed middle tier (the most over layers: sliding layers
    hold only their window). Taken from QuantizedKVCache.memory(); 0 for an unquantized cache.
    """
    tokens = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
    quantized = 0
    memory = getattr(cache, "memory", None)
    scheme = getattr(cache, "scheme", None)
    if callable(memory) and scheme is not None and scheme.quantized and tokens:
        report = memory()
        quantized = max((int(layer.tokens.get("middle", 0)) for layer in report.layers), default=0)
    return CacheStats(bytes_held=tensor_bytes(cache), tokens=tokens, quantized_tokens=quantized)


class CacheFactory:
    """Builds one fresh cache per request for `model` under `scheme` (a lowbit.kv.scheme.KVScheme)."""

    def __init__(self, model, scheme, geometry):
        self.model = model
        self.scheme = scheme
        self.geometry = geometry
        cls = _quantized_cache_class()
        if cls is None and scheme.quantized:
            raise LowbitError(
                f"KV scheme {scheme.name!r} needs lowbit.runtime.cache.QuantizedKVCache, which this lowbit build lacks; "
                "serve with --kv bf16 or install a lowbit that has the quantized cache"
            )
        self.cls = cls
        self.plan = None
        if cls is not None:
            # resolved once (rotation / levels files opened here, never per request); bad group /
            # rotation / attention type: refused before serving
            from lowbit.runtime.cache import model_device

            self.plan = plan_resolve(scheme, geometry, device=model_device(model))
            self.scheme = self.plan.scheme
        # probe once so a broken combination fails at start-up, not on the first request
        probe = self.new()
        self.cache_class = type(probe).__name__
        held = getattr(probe, "scheme", None)
        if held is not None and held != self.scheme:  # report only what the cache really holds
            raise LowbitError(f"the KV cache was built with scheme {held.name!r}, not the requested {scheme.name!r}")

    def new(self):
        if self.cls is None:
            from transformers import DynamicCache

            return DynamicCache(config=self.model.config)
        return self.cls.from_plan(self.model, self.plan)


def served_scheme(factory: CacheFactory) -> dict:
    """What the server reports on /v1/models and /metrics: the scheme its caches really use."""
    s = factory.scheme
    dims = sorted({g.head_dim_k for g in factory.geometry.layers})
    bpe_k, bpe_v = s.bits_per_element(dims[0])
    return {
        "name": s.name,
        "description": s.describe(),
        "cache": factory.cache_class,
        "quantized": bool(s.quantized),
        "k_bits": s.k.bits,
        "v_bits": s.v.bits,
        "bits_per_element": {"k": round(bpe_k, 4), "v": round(bpe_v, 4), "head_dim": dims[0]},
        "sink": s.sink,
        "recent": s.recent,
        "page": s.page,
        "rotation": s.to_dict()["rotation"],
        "recipe": s.to_dict(),
    }
