"""The integer grid compressed-tensors stores, derived from lowbit's one affine quantizer.

lowbit.quant.affine lays out a grid per group as `x_hat = codes * scale + zero` with codes in
[0, 2**b - 1] and a float `zero`. compressed-tensors (and vLLM's kernels) store instead

    x_hat = (q - zero_point) * scale,   q, zero_point signed ints in [-2**(b-1), 2**(b-1) - 1]

so `zero` must be an integer multiple of `scale`. `ct_zero_point` is THE one place that turns
affine's (scale, zero) into that integer zero-point:

    zero_point = round(-zero / scale) - 2**(b-1)     (asymmetric; clamped to the signed range)
    zero_point = 0                                   (symmetric)

and `snapped_zero` gives the affine `zero` of the snapped grid, -(zero_point + 2**(b-1)) * scale,
so codes and dequantization keep affine's single formula (unsigned code c = q + 2**(b-1)).

Asymmetric groups are fitted on the group plus one 0 element so the range always holds 0 and the integer zero-point never leaves
[0, 2**b - 1] (an all-positive group would otherwise need zero_point < -2**(b-1)). Symmetric
groups use affine's symmetric scale (2 * amax / (2**b - 1)), which equals compressed-tensors'
amax / ((2**b - 1) / 2); the snapped grid is the signed grid -2**(b-1) .. 2**(b-1) - 1 times scale.

`encode` quantizes with fixed (scale, zero) -- the step GPTQ repeats column by column -- with
affine's formula: codes = clamp(round((x - zero) / scale), 0, 2**b - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.quant import affine

# Clip ratios tried per group. Weight groups never picked ratios below ~0.8 on smollm2-135m at
# 4 bits (8 bits picks ~1.0), so the list stops at 0.78 and is spaced 0.03.
CLIP_RATIOS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.78)


@dataclass(frozen=True)
class Grid:
    """Per-group grid of a weight [out, in] in groups of `group` along `in`.

    scale:      float32 [out, in // group]  (> 0)
    zero_point: int32 [out, in // group]    compressed-tensors' signed zero-point (0 if symmetric)
    zero:       float32 [out, in // group]  affine offset of the same grid (-(zp + 2**(b-1)) * scale)
    clip:       float32 [out, in // group]  clip ratio chosen per group (1.0 = plain min/max)
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    zero: torch.Tensor
    clip: torch.Tensor
    bits: int
    group: int
    symmetric: bool

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1


def ct_zero_point(scale: torch.Tensor, zero: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """compressed-tensors' signed integer zero-point (int32) for affine's (scale, zero).

    Asymmetric: round(-zero / scale) - 2**(b-1), clamped to [-2**(b-1), 2**(b-1) - 1]. Symmetric: 0
    (affine centers the symmetric grid half a step off the signed grid; the snap moves it onto it).
    """
    half = 1 << (bits - 1)
    if symmetric:
        return torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)
    zp = torch.round(-zero.float() / scale.float()) - half
    return zp.clamp_(-half, half - 1).to(torch.int32)


def snapped_zero(scale: torch.Tensor, zero_point: torch.Tensor, bits: int) -> torch.Tensor:
    """affine `zero` (float32) of the integer grid: -(zero_point + 2**(b-1)) * scale."""
    return -(zero_point.float() + (1 << (bits - 1))) * scale.float()


def group_range(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (min, max) of w [out, in], float32 [out, in // group] each."""
    out, n = w.shape
    wg = w.float().reshape(out, n // group, group)
    return wg.amin(-1), wg.amax(-1)


def _range_params(lo: torch.Tensor, hi: torch.Tensor, bits: int, symmetric: bool, clip: float, scale_dtype):
    """affine.quantize's (scale, zero) [out, G] for groups whose min/max are lo/hi [out, G].

    affine lays a group's grid out from the group's min and max alone (amax when symmetric), so it
    is handed each group's summary [min, max, 0] as a group of 3: the same scale and zero as the
    full group plus a zero element, at a fraction of the cost (the clip search calls this often).
    Asymmetric ranges thus always include 0. scale_dtype: the dtype the checkpoint stores scales in
    (affine rounds the scale to it, upward).
    """
    out = lo.shape[0]
    summary = torch.stack([lo, hi] + ([] if symmetric else [torch.zeros_like(lo)]), dim=-1)  # [out, G, 2|3]
    k = summary.shape[-1]
    q = affine.quantize(summary.reshape(out, -1), bits, k, symmetric=symmetric, clip_ratio=clip,
                        scale_dtype=scale_dtype)
    return q.scale.float(), q.zero.float()


def _affine_params(w: torch.Tensor, bits: int, group: int, symmetric: bool, clip: float, scale_dtype):
    """affine.quantize's (scale, zero) [out, G] for w [out, in] (see _range_params)."""
    lo, hi = group_range(w, group)
    return _range_params(lo, hi, bits, symmetric, clip, scale_dtype)


def grid_for_range(
    lo: torch.Tensor, hi: torch.Tensor, bits: int, group: int, symmetric: bool, scale_dtype=torch.float32
) -> Grid:
    """The integer grid whose groups span [lo, hi] ([out, G] each; a tuned range, e.g. SignRound's).

    The same layout as grid_for_clip at ratio 1.0 on weights with those group minima and maxima;
    `clip` is 1.0 (the tuned range is itself the clipping).
    """
    scale, zero = _range_params(lo.float(), hi.float(), bits, symmetric, 1.0, scale_dtype)
    zp = ct_zero_point(scale, zero, bits, symmetric)
    clip_t = torch.ones(scale.shape, device=scale.device)
    return Grid(scale.float(), zp, snapped_zero(scale, zp, bits), clip_t, bits, group, symmetric)


def grid_for_clip(
    w: torch.Tensor, bits: int, group: int, symmetric: bool, clip: float, scale_dtype=torch.float32
) -> Grid:
    """The integer grid of w [out, in] at one clip ratio (scale exactly representable in scale_dtype)."""
    scale, zero = _affine_params(w, bits, group, symmetric, clip, scale_dtype)
    zp = ct_zero_point(scale, zero, bits, symmetric)
    clip_t = torch.full(scale.shape, float(clip), device=scale.device)
    return Grid(scale.float(), zp, snapped_zero(scale, zp, bits), clip_t, bits, group, symmetric)


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8, [0, 2**b - 1]) of x on a fixed grid; x, scale, zero broadcast together.

    Same formula as affine.quantize: clamp(round((x - zero) / scale), 0, 2**b - 1).
    """
    q = torch.round((x.float() - zero) / scale).clamp_(0, (1 << bits) - 1)
    return q.to(torch.uint8)


def decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x_hat = codes * scale + zero (float32), affine's one dequant formula."""
    return codes.float() * scale + zero


def quantize_on(w: torch.Tensor, g: Grid) -> torch.Tensor:
    """Codes uint8 [out, in] of w [out, in] on grid g (round to nearest)."""
    out, n = w.shape
    wg = w.float().reshape(out, n // g.group, g.group)  # [out, G, group]
    return encode(wg, g.scale.unsqueeze(-1), g.zero.unsqueeze(-1), g.bits).reshape(out, n)


def dequantize_on(codes: torch.Tensor, g: Grid) -> torch.Tensor:
    """float32 [out, in] from codes on grid g."""
    out, n = codes.shape
    cg = codes.reshape(out, n // g.group, g.group)
    return decode(cg, g.scale.unsqueeze(-1), g.zero.unsqueeze(-1)).reshape(out, n)


def fit_grid(
    w: torch.Tensor,
    bits: int,
    group: int,
    symmetric: bool,
    *,
    clip_search: bool = True,
    ratios=CLIP_RATIOS,
    col_weight: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> Grid:
    """Per-group grid of w [out, in] with the clip ratio chosen per group by reconstruction MSE.

    Each candidate ratio is laid out by affine.quantize, snapped to the integer grid, and scored
    on the snapped grid (what is actually stored): sum over the group of col_weight * (w - w_hat)**2
    (col_weight [in], e.g. diag(H); None = plain MSE). Ratio 1.0 is always a candidate, so the
    chosen grid is never worse than plain min/max on w. Ties keep the larger ratio.
    """
    out, n = w.shape
    w = w.float()
    wg = w.reshape(out, n // group, group)  # [out, G, group]
    cw = None if col_weight is None else col_weight.float().reshape(1, n // group, group)
    qmax = (1 << bits) - 1
    cands = sorted({float(r) for r in ratios} | {1.0}, reverse=True) if clip_search else [1.0]
    best: Grid | None = None
    best_err = None
    for r in cands:
        g = grid_for_clip(w, bits, group, symmetric, r, scale_dtype)
        s, z = g.scale.unsqueeze(-1), g.zero.unsqueeze(-1)
        # encode -> decode -> squared error, in place: (clamp(round((w - z) / s)) * s + z - w)^2
        e = wg - z
        e.div_(s).round_().clamp_(0, qmax).mul_(s).add_(z).sub_(wg).square_()
        if cw is not None:
            e.mul_(cw)
        err = e.sum(-1)  # [out, G]
        if best is None:
            best, best_err = g, err
            continue
        better = err < best_err
        if better.any():
            best = Grid(
                torch.where(better, g.scale, best.scale), torch.where(better, g.zero_point, best.zero_point),
                torch.where(better, g.zero, best.zero), torch.where(better, g.clip, best.clip), bits, group, symmetric,
            )
            best_err = torch.minimum(err, best_err)
    return best
