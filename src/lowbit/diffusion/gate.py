"""The image structure gate: per-image metrics, thresholds, and their calibration on the unquantized model.

Per image x (float [4, H, W] RGBA in [0, 1]; c = RGB * alpha, the image composited over black):
    finite        every pixel finite (a NaN anywhere fails the image outright)
    opaque        fraction of pixels with alpha > 0.5                      (the "97% transparent" failure)
    std           standard deviation of c over pixels and channels         (the "flat grey" failure)
    flat_tiles    fraction of tile x tile blocks of c whose std < FLAT_EPS (near-constant regions)
    tile_energy   fraction of c's non-DC spectral energy (2-D FFT of c's luminance) on the rows and columns
                  of the tile period's harmonics, f = k * H / tile, k >= 1 (stripes, blocks, repeated patches
                  at the DiT's patch size)
    psnr          10 log10(1 / MSE) against the unquantized image of the same class and seed (all four
                  channels; capped at PSNR_CAP dB for identical images)
The tile is the DiT's patch size (the period a broken linear or kernel shows up at).

Thresholds (Thresholds): opaque in [opaque_min, opaque_max], std >= std_min, flat_tiles <= flat_max,
tile_energy <= tile_energy_max, psnr >= psnr_min. A run with any failing image is FAIL.

Calibration (calibrate(): what the defaults are made of, and what `lowbit eval images --calibrate` does on
the run's own reference images). From the unquantized model's images over the evaluation's classes x seeds:
    a metric bounded below (opaque, std):  threshold = ref_min / 2   (half the least any honest sample had;
             "min - spread" would put opaque_min near 0 here, letting a 97%-transparent image through)
    a metric bounded above (flat_tiles, tile_energy, opaque):  threshold = ref_max + (ref_max - ref_min),
             clamped at 1 (one seed-to-seed spread beyond the most any honest sample had)
    psnr_min = the median of the seed-to-seed band + PSNR_MARGIN_DB. The band: the PSNRs between two reference
             images of one class and different seeds, i.e. how far apart two honest samples of a class are.
             An image no closer than that to its own seed's reference has lost what the seed gave it (a broken
             linear yields exactly such images, at the field's 7-9 dB). The 6 dB margin asks the error to be
             at most half the typical sample-to-sample RMS distance. The median, not the top: the top is set
             by classes whose samples barely depend on the seed (near-identical images, 30+ dB apart), which
             says nothing about where broken images land.
The DEFAULTS below are that rule applied to artifacts/dit-digits32 (classes 0-7 x seeds 0-3, 25 DDIM steps,
guidance 2; see results/images/eval.json "calibration"), rounded outward.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from lowbit.core.errors import LowbitError

# torch is imported inside the functions that use it: `lowbit eval`'s parser reads DEFAULTS, and a
# mistyped flag must not wait for torch
if TYPE_CHECKING:
    import torch

FLAT_EPS = 0.02  # std (in [0, 1] units) under which a tile counts as constant
PSNR_CAP = 100.0
MARGIN = 1.0
PSNR_MARGIN_DB = 6.0


@dataclass(frozen=True)
class Thresholds:
    opaque_min: float = 0.0
    opaque_max: float = 1.0
    std_min: float = 0.0
    flat_max: float = 1.0
    tile_energy_max: float = 1.0
    psnr_min: float = 0.0

    def check(self) -> None:
        """LowbitError naming the first threshold out of its range."""
        for f in ("opaque_min", "opaque_max", "flat_max", "tile_energy_max"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise LowbitError(f"gate threshold {f} = {v} is outside [0, 1] (a fraction of pixels / tiles / energy)")
        if self.opaque_min > self.opaque_max:
            raise LowbitError(f"gate thresholds: opaque_min {self.opaque_min} > opaque_max {self.opaque_max}")
        if not (0.0 <= self.std_min <= 0.5):
            raise LowbitError(f"gate threshold std_min = {self.std_min} is outside [0, 0.5] (pixel std in [0, 1] units)")
        if not (0.0 <= self.psnr_min <= PSNR_CAP):
            raise LowbitError(f"gate threshold psnr_min = {self.psnr_min} dB is outside [0, {PSNR_CAP:g}]")

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **kw) -> Thresholds:
        d = self.to_dict()
        d.update({k: v for k, v in kw.items() if v is not None})
        t = Thresholds(**d)
        t.check()
        return t


THRESHOLD_NAMES = tuple(f.name for f in fields(Thresholds))
# calibrate() on artifacts/dit-digits32, classes 0-7 x seeds 0-3, 25 steps, guidance 2 (see the module docstring),
# rounded outward. The reference spread it came from: opaque 0.199..0.393, std 0.152..0.252, flat tiles 0..0.375,
# tile energy 0.003..0.063, seed-to-seed PSNR 14.86..32.79 dB (median 22.92, 48 pairs) -> psnr_min 28.92.
DEFAULTS = Thresholds(opaque_min=0.099, opaque_max=0.586, std_min=0.075, flat_max=0.75, tile_energy_max=0.124,
                      psnr_min=28.9)


def composite(img: torch.Tensor) -> torch.Tensor:
    """[4, H, W] -> [3, H, W] = RGB * alpha (over black)."""
    return img[:3] * img[3:4]


def tile_energy(c: torch.Tensor, tile: int) -> float:
    """Fraction of the non-DC energy of c's luminance [H, W] at the tile period's harmonics (rows or columns)."""
    import torch

    lum = c.mean(0).double()  # [H, W]
    h, w = lum.shape
    e = torch.fft.fft2(lum - lum.mean()).abs() ** 2  # [H, W]
    e[0, 0] = 0.0
    total = float(e.sum())
    if total <= 1e-20:
        return 0.0
    fy = torch.zeros(h, dtype=torch.bool)
    fx = torch.zeros(w, dtype=torch.bool)
    if h % tile == 0:
        fy[h // tile::h // tile] = True  # k * H / tile (and their mirrors, which the stride also hits)
    if w % tile == 0:
        fx[w // tile::w // tile] = True
    mask = fy[:, None] | fx[None, :]
    return float(e[mask].sum()) / total


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    if not math.isfinite(mse):
        return float("nan")
    return PSNR_CAP if mse <= 10 ** (-PSNR_CAP / 10) else min(PSNR_CAP, 10 * math.log10(1.0 / mse))


def image_metrics(img: torch.Tensor, tile: int, ref: torch.Tensor | None = None) -> dict:
    """The metrics of one image float [4, H, W] (see module docstring); psnr only with ref."""
    import torch

    img = img.float()
    finite = bool(torch.isfinite(img).all())
    out = {"finite": finite}
    if not finite:
        return {**out, "opaque": float("nan"), "std": float("nan"), "flat_tiles": float("nan"),
                "tile_energy": float("nan"), "psnr": float("nan") if ref is not None else None}
    c = composite(img)
    _, h, w = c.shape
    t = c[:, : h - h % tile, : w - w % tile].reshape(3, h // tile, tile, w // tile, tile)
    tile_std = t.permute(1, 3, 0, 2, 4).reshape(h // tile, w // tile, -1).std(-1)  # [H/t, W/t]
    out.update(opaque=float((img[3] > 0.5).float().mean()), std=float(c.std()),
               flat_tiles=float((tile_std < FLAT_EPS).float().mean()), tile_energy=tile_energy(c, tile),
               psnr=None if ref is None else psnr(img, ref))
    return out


def failures(m: dict, th: Thresholds) -> list[str]:
    """Why an image fails the gate (empty list: it passes)."""
    if not m["finite"]:
        return ["non-finite pixels"]
    why = []
    if not (th.opaque_min <= m["opaque"] <= th.opaque_max):
        why.append(f"opaque {m['opaque']:.3f} outside [{th.opaque_min:.3f}, {th.opaque_max:.3f}]")
    if m["std"] < th.std_min:
        why.append(f"std {m['std']:.4f} < {th.std_min:.4f}")
    if m["flat_tiles"] > th.flat_max:
        why.append(f"flat tiles {m['flat_tiles']:.3f} > {th.flat_max:.3f}")
    if m["tile_energy"] > th.tile_energy_max:
        why.append(f"tile energy {m['tile_energy']:.3f} > {th.tile_energy_max:.3f}")
    if m.get("psnr") is not None and not (m["psnr"] >= th.psnr_min):
        why.append(f"psnr {m['psnr']:.2f} dB < {th.psnr_min:.2f}")
    return why


def seed_band(images: torch.Tensor, classes: list[int]) -> list[float]:
    """PSNRs between every two images of the same class (different seeds): the seed-to-seed band."""
    out = []
    for i in range(len(classes)):
        for j in range(i + 1, len(classes)):
            if classes[i] == classes[j]:
                out.append(psnr(images[i], images[j]))
    return out


def _median(v: list[float]) -> float:
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def calibrate(ref_metrics: list[dict], band: list[float]) -> tuple[Thresholds, dict]:
    """(thresholds by the module docstring's rule, the spread they came from) from the reference's metrics."""
    def spread(key):
        v = [m[key] for m in ref_metrics]
        return min(v), max(v)

    def low(key):
        return max(0.0, spread(key)[0] / 2)

    def high(key):
        lo, hi = spread(key)
        return min(1.0, hi + MARGIN * (hi - lo))

    if not ref_metrics or not all(m["finite"] for m in ref_metrics):
        raise LowbitError("the unquantized model's own images are empty or non-finite: nothing to calibrate the "
                          "gate on; check the reference pipeline")
    th = Thresholds(opaque_min=low("opaque"), opaque_max=high("opaque"), std_min=min(0.5, low("std")),
                    flat_max=high("flat_tiles"), tile_energy_max=high("tile_energy"),
                    psnr_min=min(PSNR_CAP, _median(band) + PSNR_MARGIN_DB) if band else 0.0)
    info = {k: dict(zip(("min", "max"), spread(k))) for k in ("opaque", "std", "flat_tiles", "tile_energy")}
    info["seed_band_psnr"] = ({"min": min(band), "median": _median(band), "max": max(band), "pairs": len(band)}
                              if band else None)
    info["rule"] = (f"lower bounds = reference min / 2; upper bounds = reference max + {MARGIN:g} x spread; "
                    f"psnr_min = median of the seed-to-seed band + {PSNR_MARGIN_DB:g} dB")
    th.check()
    return th, info
