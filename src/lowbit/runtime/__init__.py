"""The serving runtime: a static packed KV cache, the model step over transformers' modules, captured
decode graphs per batch bucket (CUDA), and the continuous-batching engine `lowbit serve` runs on GPU.

    static_cache.py  StaticKVCache: capacity-sized tiers per slot, device lengths, index-arithmetic writes
    step.py          ModelStep (the model's layers, no host sync), DecodeGraphs, eager_decode, prefill
"""
