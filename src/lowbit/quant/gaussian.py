"""Optimal quantizers for N(0, 1): the Lloyd-Max levels and the MSE-optimal uniform step, exact (no sampling).

    gaussian_levels(bits)        the 2**bits Lloyd-Max levels (Max 1960), float32
    gaussian_distortion(levels)  E[(x - q(x))^2] for x ~ N(0, 1), nearest-level q
    gaussian_uniform_step(bits)  the step of the best uniform grid (what affine.quantize_std lays per group)

Pure math on the standard normal: both the affine grids (quant/affine.py) and the Lloyd-Max fits
(quant/lloyd_max.py) read it; it imports neither.
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import torch

from lowbit.core.errors import LowbitError

GAUSSIAN_BITS = (1, 2, 3, 4)


_N = NormalDist()


def _cell_moments(a: float, b: float) -> tuple[float, float, float]:
    """For X ~ N(0,1) on the cell (a, b]: P, E[X; cell], E[X^2; cell] (unnormalized)."""
    pa = 0.0 if math.isinf(a) else _N.pdf(a)
    pb = 0.0 if math.isinf(b) else _N.pdf(b)
    # P via erfc on the tail side keeps precision for far cells
    p = _N.cdf(b) - _N.cdf(a) if a < 0 else 0.5 * (math.erfc(a / math.sqrt(2)) - math.erfc(b / math.sqrt(2)))
    m1 = pa - pb
    apa = 0.0 if math.isinf(a) else a * pa
    bpb = 0.0 if math.isinf(b) else b * pb
    m2 = p + apa - bpb
    return p, m1, m2


def _thresholds(levels) -> list[float]:
    return [-math.inf] + [(levels[i] + levels[i + 1]) / 2 for i in range(len(levels) - 1)] + [math.inf]


@functools.cache
def _gaussian_levels(bits: int) -> tuple[float, ...]:
    K = 1 << bits
    levels = [_N.inv_cdf((i + 0.5) / K) for i in range(K)]  # start at the quantile midpoints
    for _ in range(100_000):
        t = _thresholds(levels)
        new = []
        for i in range(K):
            p, m1, _ = _cell_moments(t[i], t[i + 1])
            new.append(m1 / p)
        new = [(new[i] - new[K - 1 - i]) / 2 for i in range(K)]  # exact symmetry of N(0,1)
        delta = max(abs(u - v) for u, v in zip(new, levels, strict=True))
        levels = new
        if delta < 1e-13:
            break
    return tuple(levels)


def gaussian_levels(bits: int) -> torch.Tensor:
    """MSE-optimal levels for N(0, 1), float64 [2**bits], ascending (Lloyd iteration, cached)."""
    if bits not in GAUSSIAN_BITS:
        raise LowbitError(f"no Gaussian Lloyd-Max codebook for {bits!r} bits; use one of {GAUSSIAN_BITS}")
    return torch.tensor(_gaussian_levels(bits), dtype=torch.float64)


def gaussian_distortion(levels: torch.Tensor | int) -> float:
    """E[(X - q(X))^2] for X ~ N(0, 1) under nearest-level quantization to `levels` (or bits)."""
    lv = gaussian_levels(levels).tolist() if isinstance(levels, int) else check_levels(levels).tolist()
    t = _thresholds(lv)
    total = 0.0
    for i, level in enumerate(lv):
        p, m1, m2 = _cell_moments(t[i], t[i + 1])
        total += m2 - 2 * level * m1 + level * level * p
    return total


@functools.cache
@functools.cache  # pure; quantize_std callers resolve it once (TensorCodec)
def gaussian_uniform_step(bits: int) -> float:
    """Step of the MSE-optimal UNIFORM grid of 2**bits levels for N(0, 1) (levels at
    (i - (2**bits - 1) / 2) * step), by golden-section search on the exact distortion.
    2 bits: ~0.996, 3: ~0.586, 4: ~0.335 (Max 1960). What `affine.quantize_std` lays out per group."""
    if bits not in GAUSSIAN_BITS:
        raise LowbitError(f"no Gaussian uniform grid for {bits!r} bits; use one of {GAUSSIAN_BITS}")
    K = 1 << bits

    def dist(step: float) -> float:
        return gaussian_distortion(torch.tensor([(i - (K - 1) / 2) * step for i in range(K)], dtype=torch.float64))

    lo, hi = 1e-3, 8.0 / (K - 1)
    phi = (math.sqrt(5) - 1) / 2
    a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
    fa, fb = dist(a), dist(b)
    for _ in range(200):  # the distortion is unimodal in the step
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - phi * (hi - lo)
            fa = dist(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + phi * (hi - lo)
            fb = dist(b)
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


def check_levels(levels: torch.Tensor) -> torch.Tensor:
    if not isinstance(levels, torch.Tensor) or levels.dim() != 1 or not (2 <= levels.numel() <= 256):
        raise LowbitError("levels must be a 1-D tensor of 2..256 values (e.g. gaussian_levels(bits))")
    if not torch.is_floating_point(levels) or not torch.isfinite(levels).all():
        raise LowbitError("levels must be finite floating-point values")
    if (levels[1:] < levels[:-1]).any():
        raise LowbitError("levels must be ascending; sort them first")
    return levels
