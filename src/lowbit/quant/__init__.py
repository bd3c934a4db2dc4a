"""Pure-torch quantization math (no model imports): affine groups, Lloyd-Max codebooks, packing."""

from lowbit.quant import affine, lloyd_max, packing
from lowbit.quant.affine import AffineQuantized, dequantize, mse_clip_search, quantize
from lowbit.quant.lloyd_max import LloydMaxQuantized
from lowbit.quant.packing import pack, unpack

__all__ = [
    "AffineQuantized",
    "LloydMaxQuantized",
    "affine",
    "dequantize",
    "lloyd_max",
    "mse_clip_search",
    "pack",
    "packing",
    "quantize",
    "unpack",
]
