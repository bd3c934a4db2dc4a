"""The quantized KV cache: a transformers Cache with sink / packed middle / recent tiers.

    cache.py      QuantizedKVCache (the Cache), hand-off to the attention, decode-kernel hook
    layer.py      QuantizedKVLayer (tiers of one layer), TierView (what an attention backend reads)
    codec.py      TensorCodec: the one quantizer (quantize -> pack) and its decoder
    attention.py  the "lowbit" attention function (online-softmax over streamed tiers), masks
    rotations.py  per-layer / per-head rotations: resolve, rotate, fold V's into weights
    memory.py     memory accounting from the live tensors
    cli_args.py   the KV flags shared by generate / eval / serve
"""

# Imported on first use (PEP 562), not with the package: `lowbit.kv.cli_args` is imported while the
# CLI builds a command's parser, and importing torch there made a mistyped flag cost 12-18 s.
_LAZY = {"QuantizedKVCache": "lowbit.kv.cache", "QuantizedKVLayer": "lowbit.kv.layer", "TierView": "lowbit.kv.layer",
         "install_attention": "lowbit.kv.attention", "lowbit_attention": "lowbit.kv.attention"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lowbit.kv' has no attribute {name!r}")


__all__ = ["QuantizedKVCache", "QuantizedKVLayer", "TierView", "install_attention", "lowbit_attention"]
