"""The DiT's training set: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes) as RGBA.

    images, labels = digits_rgba(size=32)     # float32 [N, 4, size, size] in [0, 1], int64 [N]

Per image: alpha = the digit's ink (0..16 scaled to 0..1), upsampled bilinearly from 8x8 to size x size;
RGB = a vertical gradient between two colours fixed per class (procedural, no randomness), so the colour
says the class and alpha carries the shape. RGB is kept where alpha is 0 (not premultiplied): a
transparent pixel still has a colour, and a model that turns everything transparent is visible in the
opaque fraction, not hidden by black. Everything here is deterministic.
"""

from __future__ import annotations

import colorsys
import hashlib

import torch

from lowbit.core.errors import LowbitError

NUM_CLASSES = 10
CHANNELS = 4  # R, G, B, A


def _need_sklearn():
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise LowbitError("the digits training set needs scikit-learn: pip install -c constraints-cpu.txt "
                          "-e '.[diffusion]'") from None
    return load_digits


def digits_source() -> dict:
    """Where the data comes from: scikit-learn's version and the sha256 of its bundled digits file."""
    from importlib import resources

    import sklearn

    ref = resources.files("sklearn.datasets") / "data" / "digits.csv.gz"
    return {"dataset": "sklearn.datasets.load_digits", "sklearn": sklearn.__version__,
            "file": "sklearn/datasets/data/digits.csv.gz",
            "sha256": hashlib.sha256(ref.read_bytes()).hexdigest()}


def class_colours(c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top, bottom) RGB float32 [3] of class c: hue c/10, the bottom shifted in hue and darker."""
    h = c / NUM_CLASSES
    top = colorsys.hsv_to_rgb(h, 0.75, 1.0)
    bottom = colorsys.hsv_to_rgb((h + 0.12) % 1.0, 0.85, 0.65)
    return torch.tensor(top, dtype=torch.float32), torch.tensor(bottom, dtype=torch.float32)


def rgb_field(labels: torch.Tensor, size: int) -> torch.Tensor:
    """[N] class ids -> float32 [N, 3, size, size]: each class's vertical gradient."""
    y = torch.linspace(0.0, 1.0, size).view(1, 1, size, 1)  # [1, 1, S, 1]
    tops = torch.stack([class_colours(int(c))[0] for c in labels]).view(-1, 3, 1, 1)
    bottoms = torch.stack([class_colours(int(c))[1] for c in labels]).view(-1, 3, 1, 1)
    return (tops * (1 - y) + bottoms * y).expand(-1, 3, size, size).contiguous()


def digits_rgba(size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(images float32 [1797, 4, size, size] in [0, 1], labels int64 [1797]); see the module docstring."""
    if size < 8 or size % 8:
        raise LowbitError(f"image size {size} must be a multiple of 8 (the digits are 8x8)")
    d = _need_sklearn()()
    ink = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N, 1, 8, 8]
    alpha = torch.nn.functional.interpolate(ink, size=(size, size), mode="bilinear", align_corners=False)
    labels = torch.tensor(d.target, dtype=torch.int64)
    rgb = rgb_field(labels, size)
    return torch.cat([rgb, alpha.clamp(0, 1)], dim=1), labels
