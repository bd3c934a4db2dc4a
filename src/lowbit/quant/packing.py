"""Pack 2-, 4- and 8-bit codes into uint8 along the last dim, and back.

With P = 8 // bits codes per byte, D codes pack into D // P bytes (D must be a multiple of P).
Code i of a byte sits in bits [i*bits, (i+1)*bits) of it (i = 0 is the least significant).

Layouts (which dims share a byte):
- "interleaved": byte j holds dims P*j + i, i = 0..P-1 -- neighbours share a byte.
      2-bit: byte j = d[4j] | d[4j+1] << 2 | d[4j+2] << 4 | d[4j+3] << 6
      4-bit: byte j = d[2j] | d[2j+1] << 4
- "strided": with S = D // P, byte j holds dims j + i*S, i = 0..P-1. A kernel that loads a
  contiguous row of S bytes and shifts by i*bits gets the contiguous slice of dims
  [i*S, (i+1)*S) -- no shuffle after the unpack. This is the KV middle-tier layout.
      2-bit: byte j = d[j] | d[j + D/4] << 2 | d[j + D/2] << 4 | d[j + 3D/4] << 6
      4-bit: byte j = d[j] | d[j + D/2] << 4
- 8 bits: one code per byte; both layouts are the identity.
"""

from __future__ import annotations

import torch

from lowbit.core.errors import LowbitError

BITS = (1, 2, 4, 8)  # 1: the sign bits of a 1-bit residual (lowbit.quant.residual)
LAYOUTS = ("interleaved", "strided")


def _check(bits: int, layout: str) -> int:
    if bits not in BITS:
        raise LowbitError(
            f"cannot pack {bits!r}-bit codes; packing supports bits {BITS} (store 3-bit codes unpacked)"
        )
    if layout not in LAYOUTS:
        raise LowbitError(f"unknown packing layout {layout!r}; use one of {LAYOUTS}")
    return 8 // bits


def pack(codes: torch.Tensor, bits: int, layout: str = "interleaved", *, checks: bool = True) -> torch.Tensor:
    """codes [..., D] (integer, values in [0, 2**bits)) -> uint8 [..., D * bits // 8].

    checks=False skips the range check (a host sync): for a captured GPU step, whose codes come from
    the quantizer's clamp and are in range by construction."""
    P = _check(bits, layout)
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise LowbitError(f"pack expects integer codes, got {codes.dtype}")
    if codes.dim() == 0:
        raise LowbitError("pack expects at least one dim (codes pack along the last dim)")
    D = codes.shape[-1]
    if D % P != 0:
        raise LowbitError(f"last dim {D} is not a multiple of {P} ({bits}-bit codes per byte); pad it first")
    if checks and codes.numel() > 0:
        # One reduction each: cheap next to the pack itself.
        hi, lo = int(codes.max()), int(codes.min())
        if hi >= (1 << bits) or lo < 0:
            raise LowbitError(
                f"codes out of range for {bits} bits: found [{lo}, {hi}], need [0, {(1 << bits) - 1}]"
            )
    c = codes.to(torch.uint8)
    if P == 1:
        return c.contiguous()
    lead = c.shape[:-1]
    if layout == "interleaved":
        parts = c.reshape(*lead, D // P, P).unbind(-1)  # part i: dims P*j + i
    else:
        parts = c.reshape(*lead, P, D // P).unbind(-2)  # part i: dims i*S + j
    out = parts[0].clone()
    for i in range(1, P):
        out |= parts[i] << (i * bits)
    return out


def unpack(packed: torch.Tensor, bits: int, layout: str = "interleaved") -> torch.Tensor:
    """uint8 [..., B] -> codes uint8 [..., B * 8 // bits]; inverse of pack with the same layout."""
    P = _check(bits, layout)
    if packed.dtype != torch.uint8:
        raise LowbitError(f"unpack expects uint8 packed bytes, got {packed.dtype}")
    if packed.dim() == 0:
        raise LowbitError("unpack expects at least one dim (bytes along the last dim)")
    if P == 1:
        return packed.contiguous()
    mask = (1 << bits) - 1
    parts = [(packed >> (i * bits)) & mask for i in range(P)]  # each [..., B]
    lead, B = packed.shape[:-1], packed.shape[-1]
    if layout == "interleaved":
        return torch.stack(parts, dim=-1).reshape(*lead, B * P)  # [..., B, P] -> dims P*j + i
    return torch.cat(parts, dim=-1)  # [..., P*B]: part i is dims [i*B, (i+1)*B)
