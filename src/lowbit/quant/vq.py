"""Vector quantization of K/V rows: a per-(layer, KV head) codebook of `entries` sub-vectors of `sub` dims and
one scale per row (pure torch; the codec's VQ path, lowbit.kv.codec).

A row x [D] (already rotated, as every tier holds it) is normalised by its RMS, cut into D / sub sub-vectors,
and each sub-vector stores the index of its nearest codeword (squared distance) in the head's codebook
cb [entries, sub]. The row's scale is the least-squares gain of x onto its code vector c, clamped at 0:

    s = max(0, <x, c> / <c, c>)                     x_hat = s * c,  c = cb[idx].reshape(D)

rounded to the stored scale format (fp16, or the one-byte ue5m3 grid of lowbit.quant.scale_format; the
gain is positive for any sensible codebook, so the unsigned format fits). log2(entries) / sub bits per
element of codes: "2x16" and "4x256" are 2 bits, like int2, plus 8 or 16 scale bits per row (2.125 /
2.25 b/elt at head_dim 64) and the codebook, amortised over the rows the layer holds (lowbit.kv.held).

Why: at 2 bits a scalar grid spends its 4 levels per dimension; a 2-D or 4-D codebook places its cells
where the rotated rows actually fall (CommVQ / residual-VQ family; s21 / s24 / s25 probes in
RESULTS.md). Codebooks are fitted by k-means on calibration rows (lowbit.calib.vq).

Index packing: 16 entries -> 4-bit indices in lowbit.quant.packing's "strided" layout (what the fused
kernels read for 4-bit codes); 256 entries -> one byte per index.
"""

from __future__ import annotations

import math
import re

import torch

from lowbit.core.errors import LowbitError
from lowbit.quant import packing
from lowbit.quant import scale_format as sf

SPEC_RE = re.compile(r"^(\d+)x(\d+)$")
ENTRIES = (16, 256)
SUBS = (1, 2, 4, 8)
LAYOUT = "strided"


def parse(spec: str) -> tuple[int, int]:
    """"2x16" -> (sub 2, entries 16); a one-line error for anything else."""
    m = SPEC_RE.match(str(spec).strip().lower())
    if not m:
        raise LowbitError(f"VQ spec {spec!r}: use SUBxENTRIES, e.g. 2x16 (2-dim sub-vectors, 16 codewords) or 4x256")
    sub, entries = int(m.group(1)), int(m.group(2))
    if sub not in SUBS or entries not in ENTRIES:
        raise LowbitError(f"VQ spec {spec!r}: sub-vector dims must be one of {SUBS} and entries one of {ENTRIES}")
    return sub, entries


def code_bits(entries: int) -> int:
    """Bits of one stored index (4 for 16 entries, 8 for 256)."""
    return int(math.log2(entries))


def bits_per_element(sub: int, entries: int) -> float:
    return code_bits(entries) / sub


def assign(u: torch.Tensor, cb: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
    """u float [N, d], cb float [E, d] -> index of the nearest codeword, long [N] (ties: the lowest index)."""
    cn = (cb * cb).sum(-1)
    out = torch.empty(u.shape[0], dtype=torch.long, device=u.device)
    for a in range(0, u.shape[0], chunk):
        out[a:a + chunk] = (cn[None, :] - 2.0 * u[a:a + chunk] @ cb.T).argmin(-1)
    return out


def kmeans(u: torch.Tensor, entries: int, iters: int = 20, seed: int = 0) -> torch.Tensor:
    """Lloyd's k-means on u float [N, d] -> codebook float32 [entries, d] (sample init, empty cells re-seeded
    from random points). N must be at least `entries`."""
    n, d = u.shape
    if n < entries:
        raise LowbitError(f"k-means needs at least {entries} sub-vectors to fit {entries} codewords, got {n}; "
                          "calibrate on more tokens")
    g = torch.Generator().manual_seed(seed)
    u = u.float().cpu()
    cb = u[torch.randperm(n, generator=g)[:entries]].clone()
    for _ in range(iters):
        idx = assign(u, cb)
        sums = torch.zeros(entries, d).index_add_(0, idx, u)
        cnt = torch.bincount(idx, minlength=entries).float()
        live = cnt > 0
        cb[live] = sums[live] / cnt[live, None]
        dead = int((~live).sum())
        if dead:
            cb[~live] = u[torch.randint(0, n, (dead,), generator=g)]
    return cb


def normalised_subvectors(x: torch.Tensor, sub: int) -> torch.Tensor:
    """x [..., D] -> its RMS-normalised rows cut into sub-vectors [..., D / sub, sub] (what a codebook is fitted on)."""
    x = x.float()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)
    return (x / rms).reshape(*x.shape[:-1], x.shape[-1] // sub, sub)


def encode(x: torch.Tensor, cb: torch.Tensor, scale_format: str = "fp16") -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, T, D], cb [H, E, sub] -> (idx uint8 [B, H, T, D / sub], scale float32 [B, H, T, 1]).

    The scale holds exactly the value stored: fp16-rounded, or a ue5m3 value (scale_format "ue5m3")."""
    B, H, T, D = x.shape
    sub = cb.shape[2]
    u = normalised_subvectors(x, sub)  # [B, H, T, D/sub, sub]
    cbf = cb.float()
    idx = torch.empty(B, H, T, D // sub, dtype=torch.long, device=x.device)
    for h in range(H):  # one codebook per KV head
        idx[:, h] = assign(u[:, h].reshape(-1, sub), cbf[h]).reshape(B, T, D // sub)
    c = _gather(idx, cbf)  # [B, H, T, D]
    xf = x.float()
    s = (xf * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True).clamp_min(1e-30)
    s = s.clamp_min(0.0)
    s = sf.round_to_grid(s) if scale_format == "ue5m3" else s.to(torch.float16).float()
    return idx.to(torch.uint8), s


def _gather(idx: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    """idx long [B, H, T, n], cb float [H, E, sub] -> code vectors float [B, H, T, n * sub]."""
    B, H, T, n = idx.shape
    sub = cb.shape[-1]
    heads = torch.arange(H, device=idx.device)[None, :, None, None]
    return cb[heads, idx].reshape(B, H, T, n * sub)


def decode(idx: torch.Tensor, scale: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    """idx [B, H, T, D / sub] (integer), scale float [B, H, T, 1], cb [H, E, sub] -> x_hat float32 [B, H, T, D]."""
    return _gather(idx.long(), cb.float()) * scale.float()


def pack_idx(idx: torch.Tensor, entries: int, checks: bool = True) -> torch.Tensor:
    """uint8 indices [..., n] -> stored codes: 4-bit "strided" packing for 16 entries, bytes for 256."""
    return idx if entries == 256 else packing.pack(idx, 4, LAYOUT, checks=checks)


def unpack_idx(codes: torch.Tensor, entries: int) -> torch.Tensor:
    return codes if entries == 256 else packing.unpack(codes, 4, LAYOUT)
