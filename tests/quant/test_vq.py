"""lowbit.quant.vq: spec parsing, index packing round trips, nearest-codeword assignment, k-means, and the
row encode / decode (RMS-normalised sub-vectors, least-squares row gain rounded to the stored format) at odd
sizes."""

from __future__ import annotations

import itertools

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.quant import scale_format as sf
from lowbit.quant import vq


def test_parse_and_bits():
    assert vq.parse("2x16") == (2, 16) and vq.parse(" 4X256 ") == (4, 256)
    assert vq.bits_per_element(2, 16) == 2 and vq.bits_per_element(4, 256) == 2 and vq.bits_per_element(2, 256) == 4
    for bad in ("2x15", "3x16", "x16", "2*16", "16"):
        with pytest.raises(LowbitError, match="VQ spec"):
            vq.parse(bad)


@pytest.mark.parametrize("entries,n", [(16, 2), (16, 32), (16, 6), (256, 1), (256, 16), (256, 7)])
def test_index_packing_round_trips_every_value(entries, n):
    r, j = torch.arange(entries)[:, None], torch.arange(n)[None, :]
    idx = ((r + j) % entries).to(torch.uint8)[None]  # [1, entries, n]: every value at every position
    packed = vq.pack_idx(idx, entries)
    assert packed.shape[-1] == n * vq.code_bits(entries) // 8
    assert torch.equal(vq.unpack_idx(packed, entries), idx)


def test_assign_is_the_brute_force_nearest():
    g = torch.Generator().manual_seed(0)
    u, cb = torch.randn(999, 4, generator=g), torch.randn(17, 4, generator=g)
    d = ((u[:, None, :] - cb[None]) ** 2).sum(-1)
    assert torch.equal(vq.assign(u, cb, chunk=100), d.argmin(-1))


def test_kmeans_beats_its_random_init_and_refuses_too_few_points():
    g = torch.Generator().manual_seed(1)
    u = torch.randn(4000, 2, generator=g) * torch.tensor([3.0, 0.5])
    cb = vq.kmeans(u, 16, iters=15)
    init = u[torch.randperm(4000, generator=torch.Generator().manual_seed(0))[:16]]

    def err(c):
        return float(((u - c[vq.assign(u, c)]) ** 2).sum(-1).mean())

    assert err(cb) < 0.8 * err(init)
    assert err(cb) < 0.13 * float(u.pow(2).sum(-1).mean())  # 4 bits per 2-D Gaussian point: ~ -9 dB or better
    with pytest.raises(LowbitError, match="at least 16"):
        vq.kmeans(u[:15], 16)


@pytest.mark.parametrize("B,H,T,D,sub,entries,fmt", [(1, 1, 1, 8, 2, 16, "fp16"), (2, 3, 17, 48, 4, 256, "ue5m3"),
                                                      (3, 2, 99, 64, 2, 16, "ue5m3"), (1, 3, 3, 16, 1, 16, "fp16")])
def test_encode_decode_odd_sizes(B, H, T, D, sub, entries, fmt):
    g = torch.Generator().manual_seed(D)
    x = torch.randn(B, H, T, D, generator=g) * torch.linspace(0.1, 3, T)[None, None, :, None]
    x[0, 0, 0] = 0.0  # an all-zero row decodes to zeros
    cb = torch.randn(H, entries, sub, generator=g)
    idx, s = vq.encode(x, cb, fmt)
    assert idx.shape == (B, H, T, D // sub) and idx.dtype == torch.uint8 and s.shape == (B, H, T, 1)
    if fmt == "ue5m3":
        assert torch.equal(sf.round_to_grid(s), s)
    else:
        assert torch.equal(s.half().float(), s)
    # the index is the nearest codeword of each RMS-normalised sub-vector, per head
    u = vq.normalised_subvectors(x, sub)
    for b, h in itertools.product(range(B), range(H)):
        d = ((u[b, h][..., None, :] - cb[h][None, None]) ** 2).sum(-1)  # [T, D/sub, E]
        assert torch.equal(idx[b, h].long(), d.argmin(-1))
    xh = vq.decode(idx, s, cb)
    assert torch.all(xh[0, 0, 0] == 0)
    # the row gain is the least-squares one (before rounding): no other gain does better by more than the rounding
    c = vq.decode(idx, torch.ones_like(s), cb)
    best = ((x * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True)).clamp_min(0)
    e_ls = ((best * c - x) ** 2).sum(-1)
    e_got = ((xh - x) ** 2).sum(-1)
    rounding = (best / 16) ** 2 * (c * c).sum(-1, keepdim=True)  # the stored gain is within 1/16 of the best
    assert torch.all(e_got <= e_ls + rounding.squeeze(-1) + 1e-5)
    assert torch.all(e_got <= x.pow(2).sum(-1) + 1e-6)  # never worse than storing zeros
