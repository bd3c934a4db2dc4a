"""Lloyd-Max (MSE-optimal, non-uniform) scalar codebooks and group-wise encode/decode.

A codebook is an ascending float tensor `levels [K]`, K = 2**bits, in units of the group's
standard deviation. Encoding normalizes each group of `group` consecutive elements of the
last dim by its own mean and (population) std and stores the index of the nearest level:

    x_hat = levels[codes] * std + mean          # mean, std: [..., D // group]

`gaussian_levels(bits)` is the codebook that minimises E[(X - q(X))^2] for X ~ N(0, 1),
computed by the Lloyd iteration on the standard normal density (thresholds at midpoints of
levels, levels at the conditional means of their cells) -- the numbers are derived, not typed.
`fit_levels` runs the same iteration on samples (1-D k-means) for data that is not Gaussian.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit.core.errors import LowbitError
from lowbit.quant.affine import grouped
from lowbit.quant.gaussian import (
    check_levels,
)

FIT_BITS = tuple(range(1, 9))
_STAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
@dataclass(frozen=True)
class LloydMaxQuantized:
    """codes uint8 [..., D]; mean, std [..., D // group]; levels float32 [K] ascending."""

    codes: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    levels: torch.Tensor
    group: int

    @property
    def bits(self) -> int:
        return max(1, math.ceil(math.log2(self.levels.numel())))


def _group_stats(xg: torch.Tensor, stat_dtype: torch.dtype):
    """xg float32 [..., G, g] -> mean, std in stat_dtype and their float32 values [..., G]."""
    mean = xg.mean(dim=-1)
    std = xg.std(dim=-1, correction=0)
    if not (torch.isfinite(mean).all() and torch.isfinite(std).all()):
        raise LowbitError("Lloyd-Max got inf or NaN values (or values too large); clean the input first")
    mean_s, std_s = mean.to(stat_dtype), std.to(stat_dtype)
    if not (torch.isfinite(mean_s).all() and torch.isfinite(std_s).all()):
        raise LowbitError(f"group mean/std overflow {stat_dtype}; use stat_dtype=torch.float32")
    return mean_s, std_s, mean_s.float(), std_s.float()


def _normalize(x: torch.Tensor, group: int | None, stat_dtype=torch.float32):
    """x [..., D] -> z float32 [..., G, g] (per-group standardized), mean_s, std_s, g."""
    if stat_dtype not in _STAT_DTYPES:
        raise LowbitError(f"stat_dtype {stat_dtype} unsupported; use one of {_STAT_DTYPES}")
    g, xg = grouped(x, group, "Lloyd-Max")  # [..., G, g]
    mean_s, std_s, mean, std = _group_stats(xg, stat_dtype)
    # zero-std groups: divide by 1; the stored std 0 then reconstructs the mean exactly
    safe = torch.where(std > 0, std, torch.ones_like(std))
    z = (xg - mean.unsqueeze(-1)) / safe.unsqueeze(-1)
    return z, mean_s, std_s, g


def fit_levels(
    x: torch.Tensor,
    bits: int,
    *,
    group: int | None = None,
    iters: int = 200,
    tol: float = 1e-7,
    max_samples: int = 1 << 21,
) -> torch.Tensor:
    """Fit a codebook to data by the Lloyd iteration on samples (1-D k-means).

    x: any shape. group=None fits the raw values (levels in x units); group=g first standardizes
    each group of g along the last dim exactly as `encode` does, so the levels are in std units
    and ready for encode(x, levels, g). Starts from the sample quantiles at (i + 0.5) / K;
    at most `max_samples` evenly strided samples are used. Returns float32 [2**bits],
    non-decreasing (levels may repeat when the data has fewer than 2**bits distinct values).
    """
    if bits not in FIT_BITS:
        raise LowbitError(f"cannot fit a {bits!r}-bit codebook; use bits in 1..8")
    if group is None:
        if not torch.is_floating_point(x):
            raise LowbitError(f"Lloyd-Max expects a floating-point tensor, got {x.dtype}")
        v = x.detach().reshape(-1).float()
    else:
        v = _normalize(x.detach(), group)[0].reshape(-1)
    if v.numel() == 0:
        raise LowbitError("fit_levels got no samples; pass a non-empty tensor")
    if not torch.isfinite(v).all():
        raise LowbitError("fit_levels got inf or NaN values; clean the input first")
    if v.numel() > max_samples:
        v = v[:: -(-v.numel() // max_samples)]
    v = v.double().sort().values  # [N]
    N, K = v.numel(), 1 << bits
    csum = torch.cat([v.new_zeros(1), v.cumsum(0)])  # prefix sums: cell means in O(K log N)
    idx = ((torch.arange(K, dtype=torch.float64) + 0.5) / K * N).long().clamp_(max=N - 1)
    levels = v[idx]
    scale = float(v[-1] - v[0]) or 1.0
    for _ in range(iters):
        t = (levels[1:] + levels[:-1]) / 2  # [K-1] decision thresholds
        edges = torch.cat([idx.new_zeros(1), torch.searchsorted(v, t, right=True), idx.new_full((1,), N)])
        cnt = edges[1:] - edges[:-1]  # [K]
        sums = csum[edges[1:]] - csum[edges[:-1]]
        new = torch.where(cnt > 0, sums / cnt.clamp(min=1), levels)  # empty cell keeps its level
        new = new.sort().values
        done = float((new - levels).abs().max()) <= tol * scale
        levels = new
        if done:
            break
    return levels.float()


def encode(
    x: torch.Tensor,
    levels: torch.Tensor,
    group: int | None,
    *,
    stat_dtype: torch.dtype = torch.float32,
) -> LloydMaxQuantized:
    """x [..., D] -> nearest-level codes uint8 [..., D] against per-group mean/std.

    group must divide D (None = whole dim). Math in float32; mean/std are returned in
    `stat_dtype` (fp16/bf16 for compact storage) and the codes are computed against those
    rounded values. Constant groups store std 0 and reconstruct exactly.
    """
    lv = check_levels(levels).float()
    z, mean_s, std_s, g = _normalize(x, group, stat_dtype)
    t = (lv[1:] + lv[:-1]) / 2  # [K-1] midpoints: nearest level = number of thresholds below
    codes = torch.bucketize(z, t).to(torch.uint8).reshape(x.shape)
    return LloydMaxQuantized(codes, mean_s, std_s, lv, g)


def decode(q: LloydMaxQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_hat [..., D] = levels[codes] * std + mean, computed in float32, cast to `dtype`."""
    D = q.codes.shape[-1]
    vals = q.levels.float()[q.codes.long()]  # [..., D]
    vals = vals.reshape(*q.codes.shape[:-1], D // q.group, q.group)  # [..., G, g]
    x = vals * q.std.float().unsqueeze(-1) + q.mean.float().unsqueeze(-1)
    return x.reshape(q.codes.shape).to(dtype)
