"""Probe (s20, issue 18): what fp8 (e4m3) scales would cost in quality, to price their 0.125 b/elt of held bits.

Runs `lowbit eval` (arguments as the CLI's) with lowbit.quant.affine.quantize_centred (the scale-only grids' encoder)
monkeypatched: the group's step is chosen as usual (fp32, with the "mse" search), then rounded to the nearest e4m3
value times a power-of-two multiplier per encode call (2**floor(log2(amax / 256)), standing in for the per-layer
multiplier a real fp8 field would carry), and the codes are recomputed against the rounded scale. Storage and held
bits are NOT changed by this probe: a recipe's "bits q" column still counts fp16 scales (2.25 b/elt for int2 at
head_dim 64); with fp8 scales the same recipe would hold 2.125 + 2 * (K int4 layers) / 30 / 2.
"""
import sys

import torch

import lowbit.quant.affine as A

orig = A.quantize_centred


def fp8_scaled(x, bits, group, *, grid="std", clip_ratio=1.0, scale_dtype=torch.float32, checks=True, unit_step=None,
               search=()):
    q = orig(x, bits, group, grid=grid, clip_ratio=clip_ratio, scale_dtype=torch.float32, checks=checks,
             unit_step=unit_step, search=search)
    s = q.scale.float()
    amax = s.amax()
    m = torch.exp2(torch.floor(torch.log2(amax / 256))) if amax > 0 else torch.tensor(1.0)
    s8 = (s / m).to(torch.float8_e4m3fn).float() * m
    live = s8 > 0
    mid = A.centre(bits)
    D = x.shape[-1]
    xg = x.float().reshape(*x.shape[:-1], D // q.group, q.group)
    inv = torch.where(live, 1.0 / torch.where(live, s8, torch.ones_like(s8)), torch.zeros_like(s8))
    codes = torch.round(xg * inv.unsqueeze(-1) + mid).clamp_(0, (1 << bits) - 1)
    return A.AffineQuantized(codes.to(torch.uint8).reshape(x.shape), s8.to(scale_dtype), -mid * s8, bits, q.group,
                             True, q.clip_ratio)


if __name__ == "__main__":
    A.quantize_centred = fp8_scaled
    from lowbit.cli import main

    sys.exit(main(sys.argv[1:]))
