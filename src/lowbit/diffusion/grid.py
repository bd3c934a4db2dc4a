"""PNG grids of RGBA images a person can look at: each image composited over a grey checkerboard (so
transparency shows as checks, not as black), scaled up by nearest neighbour, rows x columns."""

from __future__ import annotations

from pathlib import Path

import torch


def composite(img: torch.Tensor, check: int = 4) -> torch.Tensor:
    """float [4, H, W] RGBA in [0, 1] -> float [3, H, W] RGB over a light/dark grey checkerboard."""
    _, h, w = img.shape
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    bg = torch.where(((yy // check + xx // check) % 2) == 0, 0.18, 0.26).expand(3, h, w)
    a = img[3:4].clamp(0, 1)
    return img[:3].clamp(0, 1) * a + bg * (1 - a)


def save_grid(rows: list[torch.Tensor], path, *, scale: int = 3, pad: int = 2, labels: list[str] | None = None) -> Path:
    """rows: list of float [N, 4, H, W] (equal N, H, W) -> a PNG with one row each; returns the path.

    labels: one text per row, drawn at the left (PIL's default font)."""
    from PIL import Image, ImageDraw

    n, _, h, w = rows[0].shape
    label_w = 0 if not labels else 8 + 7 * max(len(s) for s in labels)
    cw, ch = w * scale + pad, h * scale + pad
    canvas = Image.new("RGB", (label_w + n * cw + pad, len(rows) * ch + pad), (20, 20, 20))
    draw = ImageDraw.Draw(canvas)
    for r, batch in enumerate(rows):
        for i in range(batch.shape[0]):
            rgb = (composite(batch[i].float()) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            tile = Image.fromarray(rgb, "RGB").resize((w * scale, h * scale), Image.NEAREST)
            canvas.paste(tile, (label_w + pad + i * cw, pad + r * ch))
        if labels:
            draw.text((4, pad + r * ch + ch // 2 - 6), labels[r], fill=(230, 230, 230))
    path = Path(path)
    canvas.save(path, format="PNG")
    return path
