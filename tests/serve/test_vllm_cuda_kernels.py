"""The CUDA backend's paged attention kernel against its torch twin, at odd sizes, under TRITON_INTERPRET=1.

Ragged batches (1..5 requests), GQA ratios 1/3/4/8, block size 16, lengths spanning sink / middle / recent,
decode (one query per request) and prefill chunks (several, with history), int4 / int2 / k4v2 cells,
exact tiers from a dense pool with some rows missing (read from codes), an empty request.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.attention.common import interpreted
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.vllm_plugin.cuda_kernels import paged_attention, paged_attention_ref, tiles_for
from lowbit.vllm_plugin.slot import SlotFormat

cpu_only = pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")
BS = 16


def _cache(fmt, H, lens, q_lens, D, Dv, seed, sink, recent, drop_every=0):
    """A paged cache holding each request's history (lens - q_lens tokens) at shuffled physical blocks,
    the dense pool holding its tier rows (every `drop_every`-th tier block left out: read from codes)."""
    g = torch.Generator().manual_seed(seed)
    R = len(lens)
    nbr = [-(-n // BS) for n in lens]
    NB = sum(nbr) + 3
    perm = torch.randperm(NB, generator=g)
    MB = max(nbr + [1]) + 2
    table = torch.zeros(R, MB, dtype=torch.int32)
    cache = torch.zeros(NB, H, BS, fmt.slot_bytes, dtype=torch.uint8)
    S = NB
    pk = torch.zeros(S, BS, H, D, dtype=torch.float16)
    pv = torch.zeros(S, BS, H, Dv, dtype=torch.float16)
    dmap = torch.full((NB,), -1, dtype=torch.int32)
    dvalid = torch.zeros(S, BS, dtype=torch.uint8)
    i = 0
    nslot = 0
    for r, (n, lq) in enumerate(zip(lens, q_lens)):
        for j in range(nbr[r]):
            table[r, j] = perm[i]
            i += 1
        hist = n - lq
        if hist <= 0:
            continue
        k = torch.randn(1, H, hist, D, generator=g)
        v = torch.randn(1, H, hist, Dv, generator=g)
        cells = fmt.encode_rotated(k, v, fast=False)  # [hist, H, SB]
        pos = torch.arange(hist)
        blk = table[r, pos // BS].long()
        cache[blk, :, pos % BS, :] = cells
        tier = (pos < sink) | (pos >= n - recent)
        for p in torch.nonzero(tier)[:, 0].tolist():
            b = int(blk[p])
            if dmap[b] < 0:
                if drop_every and (b % drop_every == 0):
                    continue
                dmap[b] = nslot
                nslot += 1
            s = int(dmap[b])
            pk[s, p % BS] = k[0, :, p].half()
            pv[s, p % BS] = v[0, :, p].half()
            if not (drop_every and p % 7 == 3):
                dvalid[s, p % BS] = 1
    return cache, table, (pk, pv, dmap, dvalid)


CASES = [
    # name, scheme, Hq, H, D, lens, q_lens, sink, recent
    ("int4-g1-decode", "int4", 3, 3, 32, [1, 40, 77], [1, 1, 1], 4, 9),
    ("int2-g3-decode", "int2", 6, 2, 64, [5, 33, 17, 90, 2], [1, 1, 1, 1, 1], 8, 20),
    ("k4v2-g4-decode", "k4v2", 4, 1, 32, [61, 3], [1, 1], 5, 11),
    ("int4-g8-decode", "int4", 8, 1, 32, [49], [1], 3, 7),
    ("int2-g3-prefill", "int2", 3, 1, 32, [37, 50, 19], [37, 13, 1], 4, 10),
    ("int4-g4-mixed", "int4", 8, 2, 32, [70, 1, 26, 44], [1, 1, 26, 5], 6, 12),
    ("int8-g1-notiers", "int8", 2, 2, 32, [23, 41], [1, 3], 0, 0),
]


@cpu_only
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_attention_matches_twin(case):
    name, scheme, Hq, H, D, lens, q_lens, sink, recent = case
    fmt = SlotFormat(parse_kv_scheme(scheme, sink=sink, recent=recent, page=1), D, D)
    g = torch.Generator().manual_seed(len(name))
    cache, table, tiers = _cache(fmt, H, lens, q_lens, D, D, seed=sum(lens), sink=sink, recent=recent,
                                 drop_every=5)
    T = sum(q_lens)
    q = torch.randn(T, Hq, D, generator=g)
    kn = torch.randn(T, H, D, generator=g).half()
    vn = torch.randn(T, H, D, generator=g).half()
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    scale = D ** -0.5
    ref = paged_attention_ref(q, kn, vn, cache, fmt, table, seq, qsl, scale=scale, sink=sink, recent=recent,
                              tiers=tiers)
    bm = 1 if max(q_lens) == 1 else 4
    tr, t0 = tiles_for(qsl, bm)
    got = paged_attention(q, kn, vn, cache, fmt, table, seq, qsl, tr, t0, bm=bm, scale=scale, sink=sink,
                          recent=recent, tiers=tiers, blocks_per_split=2)
    err = (got - ref).abs().max().item()
    assert err < 2e-2, f"max abs err {err}"


@cpu_only
def test_empty_request_and_padding_rows_are_zero():
    fmt = SlotFormat(parse_kv_scheme("int4", sink=0, recent=0, page=1), 32, 32)
    cache, table, _ = _cache(fmt, 1, [20, 0], [1, 0], 32, 32, seed=3, sink=0, recent=0)
    q = torch.randn(3, 2, 32)  # token 1 and 2: padding (no request)
    kn = torch.randn(3, 1, 32).half()
    vn = torch.randn(3, 1, 32).half()
    qsl = torch.tensor([0, 1, 1], dtype=torch.int32)
    seq = torch.tensor([20, 0], dtype=torch.int32)
    tr = torch.tensor([0, 1, 1], dtype=torch.int32)  # a graph-padded launch: tiles past the batch
    t0 = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = torch.full((3, 2, 32), 7.0)
    got = paged_attention(q, kn, vn, cache, fmt, table, seq, qsl, tr, t0, bm=1, scale=0.2, out=out)
    assert torch.isfinite(got).all()
    assert (got[1:] == 7.0).all()  # rows past the batch are never written
    ref = paged_attention_ref(q[:1], kn[:1], vn[:1], cache, fmt, table, seq[:1], qsl[:2], scale=0.2)
    assert (got[:1] - ref).abs().max() < 2e-2


@cpu_only
@pytest.mark.parametrize("case", [c for c in CASES if "prefill" in c[0] or "mixed" in c[0]], ids=lambda c: c[0])
def test_prefill_sdpa_matches_twin(case):
    from lowbit.vllm_plugin.cuda_kernels import prefill_attention_sdpa

    name, scheme, Hq, H, D, lens, q_lens, sink, recent = case
    fmt = SlotFormat(parse_kv_scheme(scheme, sink=sink, recent=recent, page=1), D, D)
    g = torch.Generator().manual_seed(len(name))
    cache, table, tiers = _cache(fmt, H, lens, q_lens, D, D, seed=sum(lens), sink=sink, recent=recent,
                                 drop_every=5)
    T = sum(q_lens)
    q = torch.randn(T, Hq, D, generator=g)
    kn = torch.randn(T, H, D, generator=g).half()
    vn = torch.randn(T, H, D, generator=g).half()
    qsl = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    ref = paged_attention_ref(q, kn, vn, cache, fmt, table, torch.tensor(lens), torch.tensor(qsl), scale=D ** -0.5,
                              sink=sink, recent=recent, tiers=tiers)
    for r, n in enumerate(lens):
        a, b = qsl[r], qsl[r + 1]
        got = prefill_attention_sdpa(q[a:b], kn[a:b], vn[a:b], cache, fmt, table[r], n - (b - a), n,
                                     scale=D ** -0.5, sink=sink, recent=recent, tiers=tiers)
        err = (got - ref[a:b]).abs().max().item()
        assert err < 2e-2, f"request {r}: max abs err {err}"


def test_tiles_for():
    tr, t0 = tiles_for(torch.tensor([0, 1, 6, 6, 9]), 4)
    assert tr.tolist() == [0, 1, 1, 3]
    assert t0.tolist() == [0, 1, 5, 6]
