"""The CUDA backend's step (write kernel + tier slots + paged attention) driven like vLLM drives it, on CPU under
TRITON_INTERPRET=1: ragged prompts prefilled in one batch, decode steps, a request finishing and its blocks
reused by a new one. Every step's output equals the twin over what lowbit's runtime holds: tier rows exact
(rotated, model dtype), the middle from its codes, the step's own tokens as they arrived."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.attention.common import interpreted
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.vllm_plugin.cuda_kernels import paged_attention, paged_attention_ref, tiles_for
from lowbit.vllm_plugin.cuda_tiers import TierSlots, tier_blocks
from lowbit.vllm_plugin.cuda_write import write
from lowbit.vllm_plugin.slot import SlotFormat

cpu_only = pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")
BS, H, G, D, NB = 16, 2, 3, 32, 24


def test_tier_slots_keep_release_reuse():
    ts = TierSlots(NB, 6, BS, sink=4, recent=20, device="cpu")
    assert tier_blocks(4, 20, BS) == (1, 3)
    table = torch.tensor([[3, 7, 9, 0], [5, 0, 0, 0]], dtype=torch.int32)
    ts.update(table, torch.tensor([40, 10], dtype=torch.int32))
    held = {int(b) for b in torch.nonzero(ts.dmap[:NB] >= 0)[:, 0]}
    assert held == {3, 7, 9, 5}  # req 0: sink block 3, recent 20..39 in blocks 1, 2; req 1: block 5
    slots = ts.dmap[[3, 7, 9, 5]].tolist()
    assert len(set(slots)) == 4 and all(0 <= s < 6 for s in slots)
    ts.dvalid[ts.dmap[7]] = 1
    ts.update(table[:1], torch.tensor([41], dtype=torch.int32))  # req 1 gone: block 5 released; 7 kept
    held = {int(b) for b in torch.nonzero(ts.dmap[:NB] >= 0)[:, 0]}
    assert held == {3, 7, 9}
    assert int(ts.dvalid[ts.dmap[7]].sum()) == BS  # a kept block keeps its rows
    big = torch.arange(NB, dtype=torch.int32).view(4, 6)
    ts.update(big, torch.full((4,), 96, dtype=torch.int32))  # 4 x 4 blocks wanted, 6 slots: the rest read codes
    assert int((ts.dmap[:NB] >= 0).sum()) == 6
    owners = ts.owner[:6]
    assert sorted(owners.tolist()) == sorted(torch.nonzero(ts.dmap[:NB] >= 0)[:, 0].tolist())


@cpu_only
def test_backend_step_flow_matches_twin():
    sink, recent = 4, 20
    fmt = SlotFormat(parse_kv_scheme("int2", sink=sink, recent=recent, page=1), D, D)
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(NB, H, BS, fmt.slot_bytes, dtype=torch.uint8)
    S = 4 * sum(tier_blocks(sink, recent, BS)) + 2
    ts = TierSlots(NB, S, BS, sink, recent, device="cpu")
    pool = (torch.zeros(S + 1, BS, H, D, dtype=torch.float16), torch.zeros(S + 1, BS, H, D, dtype=torch.float16))
    free = torch.randperm(NB, generator=g).tolist()
    reqs = {0: 37, 1: 5, 2: 60}  # prompt lengths; request 3 arrives when 1 finishes
    held: dict = {r: 0 for r in reqs}  # tokens held
    blocks: dict = {r: [] for r in reqs}
    rows: dict = {r: ([], []) for r in reqs}  # every row written (fp16), to build the twin's view
    for step in range(14):
        if step == 6:  # request 1 finishes; request 3 arrives with a 23-token prompt
            free += blocks.pop(1)
            held.pop(1)
            rows.pop(1)
            reqs.pop(1)
            reqs[3], held[3], blocks[3], rows[3] = 23, 0, [], ([], [])
        order = sorted(reqs)
        q_lens = [reqs[r] if held[r] == 0 else 1 for r in order]
        T = sum(q_lens)
        for r, lq in zip(order, q_lens):
            need = -(-(held[r] + lq) // BS)
            while len(blocks[r]) < need:
                blocks[r].append(free.pop())
        MB = 8
        table = torch.zeros(len(order), MB, dtype=torch.int32)
        for i, r in enumerate(order):
            table[i, : len(blocks[r])] = torch.tensor(blocks[r], dtype=torch.int32)
        seq = torch.tensor([held[r] + lq for r, lq in zip(order, q_lens)], dtype=torch.int32)
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        slots, pos, rseq = [], [], []
        for i, (r, lq) in enumerate(zip(order, q_lens)):
            for p in range(held[r], held[r] + lq):
                slots.append(blocks[r][p // BS] * BS + p % BS)
                pos.append(p)
                rseq.append(int(seq[i]))
        slots = torch.tensor(slots)
        pos_t = torch.tensor(pos, dtype=torch.int32)
        rseq_t = torch.tensor(rseq, dtype=torch.int32)
        k = torch.randn(T, H, D, generator=g).half()
        v = torch.randn(T, H, D, generator=g).half()
        q = torch.randn(T, H * G, D, generator=g)
        ts.update(table, seq)
        tiers = (pool[0], pool[1], ts.dmap, ts.dvalid)
        kro, vro = torch.empty_like(k), torch.empty_like(v)
        write(cache, fmt, k, v, slots, positions=pos_t, row_seq=rseq_t, sink=sink, recent=recent, tiers=tiers,
              rows_out=(kro, vro))
        bm = 1 if max(q_lens) == 1 else 16
        tr, t0 = tiles_for(qsl, bm)
        got = paged_attention(q, kro, vro, cache, fmt, table, seq, qsl, tr, t0, bm=bm, scale=D ** -0.5, sink=sink,
                              recent=recent, tiers=tiers, blocks_per_split=1)
        # the twin over lowbit's runtime view: every tier row exact, from a pool holding all of them
        exact = (torch.zeros(NB, BS, H, D, dtype=torch.float16), torch.zeros(NB, BS, H, D, dtype=torch.float16),
                 torch.arange(NB, dtype=torch.int32), torch.zeros(NB, BS, dtype=torch.uint8))
        for r in order:
            for p, (kk, vv) in enumerate(zip(*rows[r])):
                b = blocks[r][p // BS]
                exact[0][b, p % BS], exact[1][b, p % BS] = kk, vv
                exact[3][b, p % BS] = 1
        ref = paged_attention_ref(q, k, v, cache, fmt, table, seq, qsl, scale=D ** -0.5, sink=sink, recent=recent,
                                  tiers=exact)
        err = (got - ref).abs().max().item()
        assert err < 2e-2, f"step {step}: max abs err {err}"
        t = 0
        for r, lq in zip(order, q_lens):
            rows[r][0].extend(k[t: t + lq])
            rows[r][1].extend(v[t: t + lq])
            held[r] += lq
            t += lq
