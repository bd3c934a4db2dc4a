"""The quantized KV cache's format: what a scheme says, how one tensor is stored, and the per-layer plan.

    scheme.py     KVScheme / TensorQuant: what a KV recipe is (parse, describe, validate)
    codec.py      TensorCodec: the one quantizer (quantize -> pack) and its decoder
    layer.py      QuantizedKVLayer (tiers of one layer), TierView (what an attention backend reads)
    key_affine.py per-channel key affine maps (apply; fitting is calib's)
    rotations.py  per-layer / per-head rotations: resolve, rotate, un-rotate
    plan.py       resolve a scheme against a model's geometry once: per layer codecs, rotations, backends
    held.py       held bits: what the cache holds at a stated context
    memory.py     memory accounting from the live tensors

The cache itself (the transformers Cache) is lowbit.runtime.cache; the attention over its tiers is the
torch-stream backend (lowbit.backends.torch_stream). Nothing is imported here.
"""
