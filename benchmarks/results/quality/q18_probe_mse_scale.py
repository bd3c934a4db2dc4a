"""Probe: the tuned recipe with the centred grid's scale searched per group (MSE), by monkeypatching
lowbit.quant.affine.quantize_centred; then `lowbit eval` as usual."""
import sys

import torch

import lowbit.quant.affine as A

orig = A.quantize_centred
FACTORS = (0.75, 0.85, 0.95, 1.05, 1.15, 1.3)

def searched(x, bits, group, *, grid="std", clip_ratio=1.0, scale_dtype=torch.float32, checks=True, unit_step=None):
    best = None
    for f in (1.0,) + FACTORS:
        u = (unit_step if unit_step is not None else A_step(bits)) * f
        q = orig(x, bits, group, grid=grid, clip_ratio=clip_ratio, scale_dtype=scale_dtype, checks=checks, unit_step=u)
        xh = A.dequantize(q)
        D = x.shape[-1]
        e = (xh - x.float()).pow(2).reshape(*x.shape[:-1], D // q.group, q.group).sum(-1)  # [..., G]
        if best is None:
            best = [e, q.codes.reshape(*x.shape[:-1], D // q.group, q.group), q.scale]
        else:
            m = e < best[0]
            best[0] = torch.where(m, e, best[0])
            best[1] = torch.where(m.unsqueeze(-1), q.codes.reshape(best[1].shape), best[1])
            best[2] = torch.where(m, q.scale, best[2])
    mid = A.centre(bits)
    return A.AffineQuantized(best[1].reshape(x.shape), best[2], -mid * best[2].float(), bits, q.group, True, 1.0)

def A_step(bits):
    from lowbit.quant.lloyd_max import gaussian_uniform_step
    return gaussian_uniform_step(bits)

A.quantize_centred = searched
from lowbit.cli import main

sys.exit(main(sys.argv[1:]))
