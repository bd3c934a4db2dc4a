"""One-byte group scales: UE5M3, an unsigned 8-bit float for the positive steps of scale-only groups.

Why this format: a scale-only group (zero "none", lowbit.quant.affine.quantize_centred) stores one
positive step per group, so the sign bit of e4m3 would be wasted, and e4m3's 2**-9 .. 448 range needs a
per-tensor multiplier that a streaming KV write cannot fix in advance. Spending that bit on the exponent
gives the same 3 mantissa bits (relative step <= 1/16 after rounding to nearest) over 2**-17 .. 122880,
wide enough for every K/V step measured on the built-ins with no multiplier. torch has no unsigned fp8
dtype, so the byte is a uint8 code and this module is its one definition (the fused kernel decodes it
with the same bit layout, lowbit.kernels.attention.tiers._load_sz).

    code = E << 3 | M      E in [0, 31], M in [0, 7]
    E > 0: value = (1 + M / 8) * 2**(E - 15)    (= (8 + M) * 2**(E - 18))
    E = 0: value = M * 2**-17                   (subnormals; code 0 is exactly 0: an all-zero group)

Codes are ordered like their values, so `encode` is a bucketize on the midpoints (nearest value, ties
up) and `decode` a table lookup. In fp32 bits a normal code is ((E + 112) << 23) | (M << 20).

On the held bits: int2 at group 64 stores 2 + 8/64 = 2.125 b/elt instead of 2 + 16/64 = 2.25.
"""

from __future__ import annotations

import functools

import torch

from lowbit.core.errors import LowbitError

FORMATS = ("fp16", "ue5m3")
BITS = {"fp16": 16, "ue5m3": 8}
EXP_BIAS = 15
MAX_VALUE = 15.0 * 2.0**13  # E 31, M 7


def bits_of(fmt: str) -> int:
    """Bits one stored scale costs in format `fmt`."""
    if fmt not in BITS:
        raise LowbitError(f"scale format {fmt!r} unknown; use one of {', '.join(FORMATS)}")
    return BITS[fmt]


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32 [256] ascending, midpoints float32 [255]) on `device`, built once per device so a
    captured decode step (CUDA graph) never copies them from the host."""
    c = torch.arange(256, dtype=torch.int64)
    e, m = c >> 3, c & 7
    v = torch.where(e > 0, (8 + m).double() * torch.pow(2.0, (e - 18).double()), m.double() * 2.0**-17)
    mids = (v[1:] + v[:-1]) / 2  # exact in fp32: one more mantissa bit than the values
    return v.float().to(device), mids.float().to(device)


def values(device=None) -> torch.Tensor:
    """float32 [256] value of each UE5M3 code, ascending."""
    return _tables(torch.device(device if device is not None else "cpu"))[0]


def round_to_grid(s: torch.Tensor) -> torch.Tensor:
    """s float (>= 0) -> the nearest UE5M3 value, float32, same shape (values above MAX_VALUE saturate)."""
    return values(s.device)[encode(s).long()]


def encode(s: torch.Tensor) -> torch.Tensor:
    """s float (>= 0, finite) -> uint8 codes of the nearest UE5M3 values (ties round up), same shape."""
    mids = _tables(s.device)[1]
    return torch.bucketize(s.float().clamp(min=0.0), mids, right=True).to(torch.uint8)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> float32 values, same shape."""
    if codes.dtype != torch.uint8:
        raise LowbitError(f"UE5M3 scales are uint8 codes, got {codes.dtype}")
    return values(codes.device)[codes.long()]
