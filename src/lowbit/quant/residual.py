"""A 1-bit residual of K/V rows: the sign of what the base quantizer missed, in a random basis (pure torch;
the codec's residual path, lowbit.kv.codec). The TurboQuant / QJL family: a rotation, a scalar code, then one
more bit per element for the error.

For a row x [D] (rotated, as every tier holds it) and its base reconstruction x_b (scalar codes or VQ rows):

    r = x - x_b                                   the base's error
    u = r @ S.T                                   S [D, D]: a seeded random orthonormal basis (`basis`)
    b = (u >= 0)                                  D sign bits, packed 8 per byte ("strided", lowbit.quant.packing)
    x_hat = x_b + (g * (2 b - 1)) @ S             one gain g per row

Two gains, the same storage:
    "sign": g = mean |u|, the least-squares gain of the sign code (the smallest |x - x_hat|^2).
    "qjl":  g = |r| * sqrt(pi / (2 D)), so <q, x_hat - x_b> is an unbiased estimate of <q, r> for any query q
            (QJL, Zandieh et al. 2024; TurboQuant's inner-product stage): with S's rows near-Gaussian directions,
            E[sign(s . r) (s . q)] = sqrt(2 / pi) (r . q) / (|r| sqrt(D)) per row of S. Larger than "sign"'s gain
            by pi / 2 on Gaussian residuals: no bias in the scores, more variance.
The gain is stored in the tensor's scale format (fp16, or one-byte ue5m3: lowbit.quant.scale_format); costs
1 + 16 / D (or 8 / D) bits per element on top of the base.

Why a random basis and not the stored one: the error of a scalar grid is spread evenly over the rotated dims,
but its signs there are what the grid's own rounding left; a second, independent rotation makes the D signs a
sketch of the error's direction (each bit sees every dim). Attention reads it without rebuilding rows:
q . (g s @ S) = (q @ S.T) . (g s), so a fused kernel scores the sign bits against one extra rotated query, and
for values sums p (g s) in S's basis and rotates that sum back once (lowbit.kernels.attention.vq).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from lowbit.core.errors import LowbitError
from lowbit.quant import packing
from lowbit.quant import scale_format as sf

KINDS = ("sign", "qjl")
SEED = 20261205
LAYOUT = "strided"


@lru_cache(maxsize=16)
def _basis_cpu(D: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + D)
    a = torch.randn(D, D, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(r))[None, :]).float().contiguous()  # Haar-distributed


@lru_cache(maxsize=64)
def _basis_on(D: int, device: str) -> torch.Tensor:
    return _basis_cpu(D).to(device)  # copied once per device: a captured step never copies from the host


def basis(D: int, device=None) -> torch.Tensor:
    """The residual basis S float32 [D, D] (orthonormal rows), the same for every layer at head_dim D."""
    if D < 8 or D % 8:
        raise LowbitError(f"a 1-bit residual packs 8 signs per byte: head_dim {D} must be a multiple of 8")
    return _basis_on(int(D), str(torch.device(device if device is not None else "cpu")))


def check_kind(kind: str) -> str:
    k = str(kind).strip().lower()
    if k not in KINDS:
        raise LowbitError(f"residual {kind!r} unknown; use one of {', '.join(KINDS)} (or none)")
    return k


def encode(r: torch.Tensor, kind: str, scale_format: str = "fp16") -> tuple[torch.Tensor, torch.Tensor]:
    """Residual rows r [..., D] float -> (sign bits packed uint8 [..., D / 8], gain [..., 1] float32 rounded to
    the scale format's grid)."""
    D = r.shape[-1]
    S = basis(D, r.device)
    r = r.float()
    u = r @ S.T  # [..., D]
    bits = (u >= 0).to(torch.uint8)
    if kind == "sign":
        g = u.abs().mean(-1, keepdim=True)
    else:
        g = r.norm(dim=-1, keepdim=True) * math.sqrt(math.pi / (2 * D))
    g = sf.round_to_grid(g) if scale_format == "ue5m3" else g.half().float()
    return packing.pack(bits, 1, LAYOUT, checks=False), g


def decode(packed: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """(packed sign bits uint8 [..., D / 8], gain float [..., 1]) -> the residual's reconstruction float32 [..., D]."""
    s = packing.unpack(packed, 1, LAYOUT).float() * 2.0 - 1.0  # [..., D]
    return (s * gain.float()) @ basis(s.shape[-1], s.device)
