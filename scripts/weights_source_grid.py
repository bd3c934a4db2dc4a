"""Is a built-in model's fp32 weight already on a 4-bit grid? (smollm2-135m comes from a Q4_1 GGUF.)

    .venv/bin/python scripts/weights_source_grid.py [--model smollm2-135m] [--block 32]

1. Lists the GGUF tensor types per kind (gguf.GGUFReader on the file lowbit.models.registry points to).
2. On the loaded fp32 model (what every quantizer here starts from), per block of --block inputs of
   every linear: the count of distinct values (Q4_1: <= 16) and whether they lie on a uniform grid
   lo + d * k, k in 0..15 (d: the smallest gap between distinct values; max residual in units of d).
3. Where that grid sits against the integer zero-point grid compressed-tensors stores,
   (q - zp) * s: frac(lo / d) is 0 only when the source grid holds 0, and is what an asymmetric
   RTN with s = d cannot represent; plus the relative weight MSE of lowbit's asymmetric RTN at
   group 32 and 64 (no clip search) against the source weights.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import torch
from torch import nn

from lowbit.models import load
from lowbit.models.registry import get_builtin
from lowbit.weights.gptq import rtn_quantize


def gguf_types(name: str) -> dict[str, int]:
    import gguf

    with tempfile.TemporaryDirectory() as td:
        r = gguf.GGUFReader(str(get_builtin(name).gguf_path(Path(td))))
        c = collections.Counter()
        for t in r.tensors:
            kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name
            c[f"{kind}:{t.tensor_type.name}"] += 1
    return dict(sorted(c.items()))


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {"model": a.model, "gguf_tensor_types": gguf_types(a.model), "block": a.block}
    lm = load(a.model, dtype=torch.float32)
    blocks = le16 = ongrid = exact32 = nw = 0
    max_distinct, max_resid = 0, 0.0
    fracs = []
    mse = {32: [0.0, 0.0], 64: [0.0, 0.0]}
    for name, m in lm.model.named_modules():
        if not isinstance(m, nn.Linear) or name.endswith("lm_head"):
            continue
        W = m.weight.detach().double()  # [out, in]
        out, n = W.shape
        s, _ = W.reshape(out, n // a.block, a.block).sort(-1)  # [out, G, block]
        gaps = s.diff(dim=-1)
        distinct = 1 + (gaps > 0).sum(-1)
        d = torch.where(gaps > 0, gaps, torch.full_like(gaps, float("inf"))).amin(-1)  # smallest step
        lo = s[..., 0]
        k = (s - lo.unsqueeze(-1)) / d.unsqueeze(-1)  # grid index of every value
        resid = (k - k.round()).abs().amax(-1)
        blocks += distinct.numel()
        le16 += int((distinct <= 16).sum())
        ongrid += int(((resid < 1e-3) & (k.round().amax(-1) <= 15)).sum())
        max_distinct, max_resid = max(max_distinct, int(distinct.max())), max(max_resid, float(resid.max()))
        f = lo / d
        fracs.append((f - f.round()).flatten().float())
        for g, acc in mse.items():
            err = rtn_quantize(m.weight.detach(), 4, g, False, clip_search=False).dequantize().double() - W
            acc[0] += float(err.square().sum())
            acc[1] += float(W.square().sum())
            if g == 32:
                exact32 += int((err.abs() < 1e-7).sum())
                nw += W.numel()
    fr = torch.cat(fracs).abs()
    res.update(
        blocks=blocks, blocks_le16_distinct=le16, blocks_on_uniform_16_level_grid=ongrid, max_distinct=max_distinct,
        max_offgrid_residual_in_steps=max_resid,
        mean_abs_frac_lo_over_d=round(float(fr.mean()), 4),
        share_blocks_grid_holds_zero_within_1pct=round(float((fr < 0.01).float().mean()), 4),
        rtn_asym_g32_rel_mse=mse[32][0] / mse[32][1], rtn_asym_g64_rel_mse=mse[64][0] / mse[64][1],
        rtn_asym_g32_share_weights_exact=round(exact32 / nw, 4),
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
