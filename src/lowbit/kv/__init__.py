"""The quantized KV cache: a transformers Cache with sink / packed middle / recent tiers.

    cache.py      QuantizedKVCache (the Cache), hand-off to the attention, decode-kernel hook
    layer.py      QuantizedKVLayer (tiers of one layer), TierView (what an attention backend reads)
    codec.py      TensorCodec: the one quantizer (quantize -> pack) and its decoder
    attention.py  the "lowbit" attention function (online-softmax over streamed tiers), masks
    rotations.py  per-layer / per-head rotations: resolve, rotate, fold V's into weights
    memory.py     memory accounting from the live tensors
    cli_args.py   the KV flags shared by generate / eval / serve
"""

from lowbit.kv.attention import install_attention, lowbit_attention
from lowbit.kv.cache import QuantizedKVCache
from lowbit.kv.layer import QuantizedKVLayer, TierView

__all__ = ["QuantizedKVCache", "QuantizedKVLayer", "TierView", "install_attention", "lowbit_attention"]
