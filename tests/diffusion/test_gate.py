import math

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.diffusion.gate import DEFAULTS, Thresholds, calibrate, failures, image_metrics, psnr, seed_band


def digit_like(seed: int, size: int = 24) -> torch.Tensor:
    """A smooth blob of ink on a coloured field: RGBA [4, size, size]."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    cx, cy = (torch.rand(2, generator=g) - 0.5) * 0.4
    r = ((xx - cx) ** 2 + (yy - cy) ** 2).sqrt()
    alpha = torch.exp(-((r - 0.5) ** 2) / 0.03)
    rgb = torch.stack([0.9 * torch.ones_like(xx), 0.4 + 0.3 * yy.abs(), 0.2 * torch.ones_like(xx)])
    return torch.cat([rgb, alpha[None]])


def test_metrics_catch_the_field_failures():
    good = image_metrics(digit_like(0), tile=4)
    assert good["finite"] and 0.1 < good["opaque"] < 0.6 and good["std"] > 0.1
    grey = torch.full((4, 24, 24), 0.5)
    m = image_metrics(grey, tile=4)
    assert m["std"] < 1e-6 and m["flat_tiles"] == 1.0
    clear = digit_like(0).clone()
    clear[3] *= 0.05  # ~all transparent
    assert image_metrics(clear, tile=4)["opaque"] == 0.0
    nan = digit_like(0).clone()
    nan[1, 3, 5] = float("nan")
    assert failures(image_metrics(nan, tile=4, ref=digit_like(0)), DEFAULTS) == ["non-finite pixels"]


def test_tile_energy_sees_the_patch_period():
    smooth = digit_like(1, size=32)
    blocky = smooth.clone()
    blocky[:, ::8, :] = 0.0  # a dark line every 8 pixels: a broken patch seam
    blocky[:, :, ::8] = 0.0
    e_s, e_b = image_metrics(smooth, tile=8)["tile_energy"], image_metrics(blocky, tile=8)["tile_energy"]
    assert e_b > 3 * e_s and e_b > e_s + 0.1
    # the same seams at another period than the tile count far less
    off = smooth.clone()
    off[:, ::6, :] = 0.0
    off[:, :, ::6] = 0.0
    assert image_metrics(off, tile=8)["tile_energy"] < 0.6 * e_b


def test_psnr_and_seed_band():
    a = digit_like(2)
    assert psnr(a, a) == 100.0
    b = a + 0.01
    assert abs(psnr(a, b) - 40.0) < 1e-4
    imgs = torch.stack([digit_like(s) for s in range(4)])
    band = seed_band(imgs, [0, 0, 1, 1])
    assert len(band) == 2 and all(math.isfinite(x) for x in band)


def test_calibration_rule():
    ms = [image_metrics(digit_like(s), tile=4) for s in range(5)]
    band = [12.0, 15.5, 14.0]
    th, info = calibrate(ms, band)
    lo, hi = info["opaque"]["min"], info["opaque"]["max"]
    assert th.opaque_min == pytest.approx(lo / 2) and th.opaque_max == pytest.approx(hi + hi - lo)
    assert th.psnr_min == 14.0 + 6.0  # median of the band + 6 dB
    assert info["seed_band_psnr"]["median"] == 14.0
    assert all(not failures(m, th) for m in ms)  # the reference passes its own calibration


@pytest.mark.parametrize("kw,what", [({"opaque_min": -0.1}, "opaque_min"), ({"flat_max": 1.5}, "flat_max"),
                                     ({"psnr_min": 120}, "psnr_min"), ({"std_min": 0.9}, "std_min"),
                                     ({"opaque_min": 0.6, "opaque_max": 0.5}, "opaque_min 0.6 > opaque_max")])
def test_thresholds_out_of_range(kw, what):
    with pytest.raises(LowbitError, match=what):
        Thresholds().replace(**kw)
