"""Group-wise affine (uniform) quantization along the last dim.

Every scheme here -- asymmetric, symmetric, clipped or not -- dequantizes with ONE formula,
the one every kernel implements:

    x_hat = codes * scale + zero          # codes uint8 in [0, 2**bits - 1]

`zero` is a float offset in x units (not an integer zero-point). For asymmetric groups the grid
spans the group's [min, max]; for symmetric groups it spans [-amax, amax] with
`zero = -mid * scale`, `mid = (2**bits - 1) / 2`, so the codes are centered on `mid` and the
levels are +-scale/2, +-3*scale/2, ... (no level wasted, none exactly at 0).

Clip ratio r in (0, 1]: the group's range is shrunk toward its center by r before the grid is
laid out. Asymmetric: [min, max] -> [c - r*h, c + r*h] with c = (min+max)/2, h = (max-min)/2.
Symmetric: amax -> r*amax (center 0). So r = 0.92 means the grid covers the central 92% of
the group's observed range (4% trimmed off each end of the span, not 4% of the samples);
values outside are clamped to the end levels. r = 1 is plain min/max. It is a range ratio, not
a sample quantile: no sort is needed, so it is cheap on the KV write path.

All math runs in float32 whatever the input dtype. scale/zero are returned in float32 by
default or in `scale_dtype` (fp16/bf16, what the KV cache stores). In that case the scale is
rounded to that dtype first (upward, so the grid still spans the range), the zero is derived
from the rounded scale (grid centered on the range, then rounded), and the codes are computed
against the rounded scale/zero -- so the stored values reconstruct as well as the dtype allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.core.errors import LowbitError
from lowbit.quant import scale_format as sf
from lowbit.quant.gaussian import gaussian_uniform_step

BITS = (2, 3, 4, 8)
DEFAULT_CLIP_RATIOS = (1.0, 0.98, 0.96, 0.94, 0.92, 0.90, 0.88, 0.85, 0.82, 0.78, 0.74, 0.70)
_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AffineQuantized:
    """Quantized tensor. x_hat = codes * scale + zero (scale/zero broadcast over each group).

    codes: uint8 [..., D]; scale, zero: [..., D // group] (float32, or the requested scale_dtype).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int
    symmetric: bool
    clip_ratio: float = 1.0


def check_bits(bits: int) -> int:
    if bits not in BITS:
        raise LowbitError(f"unsupported bit width {bits!r} for affine quantization; use one of {BITS}")
    return int(bits)


def check_group(dim: int, group: int | None) -> int:
    """Return the group size for a last dim of `dim` (None -> the whole dim)."""
    if group is None:
        return dim
    if not isinstance(group, int) or group <= 0:
        raise LowbitError(f"group must be a positive integer, got {group!r}")
    if dim % group != 0:
        # Prefer power-of-two divisors below the asked group (what kernels like), then any.
        below = [d for d in range(min(group, dim), 0, -1) if dim % d == 0]
        divisors = ([d for d in below if d & (d - 1) == 0 and d > 1] + below)[:2]
        divisors = list(dict.fromkeys(divisors))
        hint = " or ".join(str(d) for d in divisors)
        raise LowbitError(f"group {group} does not divide dim {dim}; pick a divisor such as {hint}")
    return group


def _check_clip(clip_ratio: float) -> float:
    r = float(clip_ratio)
    if not (0.0 < r <= 1.0):
        raise LowbitError(f"clip ratio {clip_ratio!r} is outside (0, 1]; use 1.0 for no clipping")
    return r


def _round_up(t32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round a positive float32 tensor to `dtype`, never below its float32 value."""
    r = t32.to(dtype)
    low = r.float() < t32  # branch-free (no host sync): a captured decode step quantizes through here
    return torch.where(low, torch.nextafter(r, torch.full_like(r, float("inf"))), r)


def grouped(x: torch.Tensor, group: int | None, who: str = "quantize") -> tuple[int, torch.Tensor]:
    """x [..., D] -> (g, xg float32 [..., D//g, g]) after the input checks every group quantizer shares
    (`who` names the caller in the error)."""
    if not torch.is_floating_point(x):
        raise LowbitError(f"{who} expects a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise LowbitError(f"{who} expects at least one dim (groups run along the last dim)")
    D = x.shape[-1]
    g = check_group(D, group)
    return g, x.float().reshape(*x.shape[:-1], D // g, g)


def _groups(x: torch.Tensor, bits: int, group: int | None, scale_dtype: torch.dtype):
    """Checks shared by the quantizers; returns (bits, g, xg float32 [..., D//g, g])."""
    bits = check_bits(bits)
    if scale_dtype not in _SCALE_DTYPES:
        raise LowbitError(f"scale_dtype {scale_dtype} unsupported; use one of {_SCALE_DTYPES}")
    g, xg = grouped(x, group)
    return bits, g, xg


def _lay_grid(xg: torch.Tensor, center: torch.Tensor, step: torch.Tensor, bits: int, scale_dtype: torch.dtype,
              checks: bool = True):
    """The grid of 2**bits levels `step` apart centred on `center` ([..., G] each), stored in scale_dtype.

    Groups with step 0 get scale 1, zero = center, codes 0 (exact for constant groups). The scale is
    rounded up to scale_dtype (the grid still spans the range), the zero derived from it and rounded,
    and the codes computed against those stored values. Returns codes uint8 [..., G, g], scale, zero.
    checks=False skips the two finiteness checks (each a host sync): for a captured GPU step, where
    nothing may synchronise; the arithmetic is the same.
    """
    if checks and (not torch.isfinite(step).all() or not torch.isfinite(center).all()):
        raise LowbitError("quantize got inf or NaN values in x; clean the input before quantizing")
    qmax = (1 << bits) - 1
    live = step > 0
    scale = torch.where(live, step, torch.ones_like(step))
    if scale_dtype != torch.float32:
        scale = _round_up(scale, scale_dtype).float()
    # Grid centered on the range; with a rounded-up scale it spans a bit more.
    zero = torch.where(live, center - scale * (qmax * 0.5), center)
    scale_s, zero_s = scale.to(scale_dtype), zero.to(scale_dtype)
    if checks and not (torch.isfinite(scale_s).all() and torch.isfinite(zero_s).all()):
        raise LowbitError(f"scale/zero overflow {scale_dtype}; values too large for it, use scale_dtype=torch.float32")
    zero = zero_s.float()
    codes = torch.round((xg - zero.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, qmax)
    return codes.to(torch.uint8), scale_s, zero_s


def quantize(
    x: torch.Tensor,
    bits: int,
    group: int | None,
    *,
    symmetric: bool = False,
    clip_ratio: float = 1.0,
    scale_dtype: torch.dtype = torch.float32,
    checks: bool = True,
) -> AffineQuantized:
    """Quantize x [..., D] in groups of `group` consecutive elements of the last dim.

    bits in {2, 3, 4, 8}; group must divide D (None = whole dim); clip_ratio in (0, 1] (see
    module docstring); scale_dtype float32 / float16 / bfloat16 for the returned scale and zero.
    Constant groups reconstruct exactly (scale 1, codes 0, zero = the value). Returns
    AffineQuantized(codes uint8 [..., D], scale [..., D//group], zero [..., D//group]).
    """
    r = _check_clip(clip_ratio)
    bits, g, xg = _groups(x, bits, group, scale_dtype)  # xg [..., G, g]
    if symmetric:
        amax = xg.abs().amax(dim=-1)  # [..., G]
        center = torch.zeros_like(amax)
        half = amax * r
    else:
        lo, hi = xg.amin(dim=-1), xg.amax(dim=-1)  # [..., G]
        center = (lo + hi) * 0.5
        half = (hi - lo) * (0.5 * r)
    codes, scale, zero = _lay_grid(xg, center, half * (2.0 / ((1 << bits) - 1)), bits, scale_dtype, checks)
    return AffineQuantized(codes.reshape(x.shape), scale, zero, bits, g, bool(symmetric), r)


def quantize_std(
    x: torch.Tensor,
    bits: int,
    group: int | None,
    *,
    scale_dtype: torch.dtype = torch.float32,
    checks: bool = True,
    unit_step: float | None = None,
) -> AffineQuantized:
    """Uniform grid placed by each group's mean and standard deviation instead of its min/max.

    The grid is the MSE-optimal uniform quantizer of a Gaussian with the group's mean and std
    (step = gaussian.gaussian_uniform_step(bits) * std, centred on the mean); values beyond the
    end levels clamp. For the many-outlier-free groups a rotation produces this beats min/max at
    2 bits (min/max of 64 Gaussian values sits at ~2.4 std, so its step is ~1.6x too coarse).
    Same storage and ONE dequant formula as `quantize`: x_hat = codes * scale + zero, so every
    kernel reads it unchanged. Zero-std groups reconstruct exactly (scale 1, zero = the value).
    bits in {2, 3, 4}. unit_step: gaussian_uniform_step(bits) when the caller resolved it already (a
    compiled step cannot call the cached search). Returns AffineQuantized(symmetric=False, clip_ratio=1.0).
    """
    if bits not in (2, 3, 4):
        raise LowbitError(f"the std-placed grid is for 2, 3 or 4 bits, got {bits}; use the min/max grid at 8 bits")
    bits, g, xg = _groups(x, bits, group, scale_dtype)  # xg [..., G, g]
    mean, std = xg.mean(dim=-1), xg.std(dim=-1, correction=0)  # [..., G]
    step = gaussian_uniform_step(bits) if unit_step is None else unit_step
    codes, scale, zero = _lay_grid(xg, mean, std * step, bits, scale_dtype, checks)
    return AffineQuantized(codes.reshape(x.shape), scale, zero, bits, g, False, 1.0)


def centre(bits: int) -> float:
    """mid = (2**bits - 1) / 2: the code a scale-only (centred) grid is measured from (1.5 at 2 bits)."""
    return ((1 << int(bits)) - 1) * 0.5


# Step multiples the "mse" grid (lowbit.kv.scheme.TensorQuant grid "mse") tries per group around the std grid's step:
# denser near 1, where most groups of rotated K/V land; wider above 1 for heavy-tailed groups.
MSE_STEPS = (0.75, 0.85, 0.92, 1.0, 1.08, 1.16, 1.3, 1.45)


def quantize_centred(
    x: torch.Tensor,
    bits: int,
    group: int | None,
    *,
    grid: str = "std",
    clip_ratio: float = 1.0,
    scale_dtype: torch.dtype = torch.float32,
    checks: bool = True,
    unit_step: float | None = None,
    search: tuple[float, ...] = (),
    scale_format: str = "fp16",
) -> AffineQuantized:
    """A grid centred on 0 whose only per-group parameter is the scale (nothing else is stored).

        x_hat = (codes - mid) * scale,  mid = (2**bits - 1) / 2     (levels +-scale/2, +-3*scale/2, ...)

    i.e. the ONE formula with zero = -mid * scale, which the caller need not store: it follows from the
    scale (exactly, in float32). grid "std": step = gaussian_uniform_step(bits) * the group's RMS about 0
    (the MSE-optimal uniform grid of a zero-mean Gaussian; 2-4 bits); grid "absmax": the symmetric
    min/max grid, step = 2 * clip_ratio * amax / (2**bits - 1). Meant for data whose per-channel offset was
    removed before (a key shift): the group's own mean is not kept. The scale is rounded up to
    scale_dtype and the codes computed against the rounded scale; an all-zero group gets scale 0
    (reconstructs 0 exactly). Returns AffineQuantized(scale in scale_dtype, zero float32 = -mid * scale,
    symmetric=True).

    search: step multiples to try besides 1 (e.g. MSE_STEPS): each group keeps the rounded scale whose
    reconstruction has the least squared error (ties keep the earlier candidate, 1 first). Only the
    encoder changes: what is stored, and how it is read, is the same as without the search.

    scale_format "ue5m3": each candidate step is rounded to the nearest one-byte UE5M3 value
    (lowbit.quant.scale_format) instead of to scale_dtype, which must then be float32: the returned
    scale holds those values exactly (the caller stores their codes), and the codes are computed
    against them, as for fp16.
    """
    if grid not in ("std", "absmax"):
        raise LowbitError(f"centred grid {grid!r} unknown; use 'std' or 'absmax'")
    if grid == "std" and bits not in (2, 3, 4):
        raise LowbitError(f"the std-placed grid is for 2, 3 or 4 bits, got {bits}; use the absmax grid at 8 bits")
    r = _check_clip(clip_ratio)
    sf.bits_of(scale_format)
    if scale_format != "fp16" and scale_dtype != torch.float32:
        raise LowbitError(f"scale_format {scale_format!r} returns its values in float32; pass scale_dtype=torch.float32")
    bits, g, xg = _groups(x, bits, group, scale_dtype)  # xg [..., G, g]
    qmax = (1 << bits) - 1
    if grid == "std":
        step = xg.pow(2).mean(dim=-1).sqrt() * (gaussian_uniform_step(bits) if unit_step is None else unit_step)
    else:
        step = xg.abs().amax(dim=-1) * (2.0 * r / qmax)  # [..., G]
    if checks and not torch.isfinite(step).all():
        raise LowbitError("quantize got inf or NaN values in x; clean the input before quantizing")
    live = step > 0
    mid = centre(bits)
    factors = (1.0, *(float(c) for c in search if float(c) != 1.0))
    if not all(f > 0 for f in factors):
        raise LowbitError(f"scale search multiples must be > 0, got {tuple(search)}")
    best = None  # (squared error [..., G], scale float32 [..., G], codes [..., G, g])
    for f in factors:
        st = step * f
        if scale_format == "ue5m3":
            scale = sf.round_to_grid(st)
        else:
            scale = st if scale_dtype == torch.float32 else _round_up(st, scale_dtype).float()
        scale = torch.where(live, scale, torch.zeros_like(scale))
        pos = scale > 0  # a tiny step can round to a zero one-byte scale: that group reconstructs 0
        inv = torch.where(pos, 1.0 / torch.where(pos, scale, torch.ones_like(scale)), torch.zeros_like(scale))
        codes = torch.round(xg * inv.unsqueeze(-1) + mid).clamp_(0, qmax)
        if not search:
            best = (None, scale, codes)
            break
        err = ((codes - mid) * scale.unsqueeze(-1) - xg).pow(2).sum(-1)  # [..., G]
        if best is None:
            best = (err, scale, codes)
            continue
        better = err < best[0]  # branch-free: a captured decode step encodes through here
        best = (torch.where(better, err, best[0]), torch.where(better, scale, best[1]),
                torch.where(better.unsqueeze(-1), codes, best[2]))
    _, scale, codes = best
    scale_s = scale.to(scale_dtype)
    if checks and not torch.isfinite(scale_s).all():
        raise LowbitError(f"scale overflows {scale_dtype}; values too large for it, use scale_dtype=torch.float32")
    return AffineQuantized(codes.to(torch.uint8).reshape(x.shape), scale_s, -mid * scale, bits, g, True, r)


def dequantize(q: AffineQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_hat [..., D] = codes * scale + zero, computed in float32 and cast to `dtype`."""
    D = q.codes.shape[-1]
    cg = q.codes.float().reshape(*q.codes.shape[:-1], D // q.group, q.group)  # [..., G, g]
    x = cg * q.scale.float().unsqueeze(-1) + q.zero.float().unsqueeze(-1)
    return x.reshape(q.codes.shape).to(dtype)


def fake_quantize(x: torch.Tensor, bits: int, group: int | None, **kw) -> torch.Tensor:
    """dequantize(quantize(x, ...)) in x's dtype."""
    return dequantize(quantize(x, bits, group, **kw), x.dtype)


def quant_mse(x: torch.Tensor, bits: int, group: int | None, **kw) -> float:
    """Mean squared reconstruction error (float32) of quantize -> dequantize."""
    xh = dequantize(quantize(x, bits, group, **kw))
    return float((xh - x.float()).pow(2).mean())


def mse_clip_search(
    x: torch.Tensor,
    bits: int,
    group: int | None,
    *,
    symmetric: bool = False,
    ratios=DEFAULT_CLIP_RATIOS,
    scale_dtype: torch.dtype = torch.float32,
) -> float:
    """The clip ratio from `ratios` with the smallest reconstruction MSE on x (one for all of x).

    1.0 (no clip) is always a candidate, so the result never does worse than no clipping on x;
    ties go to the larger ratio. Returns a float in (0, 1].
    """
    cands = sorted({_check_clip(r) for r in ratios} | {1.0}, reverse=True)
    best_r, best = 1.0, float("inf")
    for r in cands:
        err = quant_mse(x, bits, group, symmetric=symmetric, clip_ratio=r, scale_dtype=scale_dtype)
        if err < best:
            best_r, best = r, err
    return best_r
