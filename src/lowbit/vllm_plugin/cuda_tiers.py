"""The CUDA backend's exact-tier bookkeeping: which physical blocks hold a dense copy of their tier rows
(pure torch, device-side, no host synchronisation; no vLLM import).

The tier pool of a layer is [S, block_size, H_kv, D] in the model dtype; `TierSlots` maps a physical block
id to a pool slot. Every step (in the metadata builder, before the layers run) the blocks that hold a
running request's sink rows (positions < sink) or its recent window (positions >= seq_len - recent) keep
their slot or get a free one; every other block's slot is released. A row the attention reads as a tier
row was a tier row when it was written (seq_len only grows), so a block that keeps its slot holds every
tier row it will be asked for; a block that got no slot (pool full) is read from its codes.
"""

from __future__ import annotations

import torch


def tier_blocks(sink: int, recent: int, bs: int) -> tuple[int, int]:
    """Blocks a request's sink tier spans, and its recent window at most."""
    return -(-sink // bs) if sink else 0, (-(-recent // bs) + 1) if recent else 0


class TierSlots:
    """Physical block -> slot of the dense tier pool, kept on the device (dmap int32 [NB + 1], owner int64
    [S + 1], dvalid uint8 [S + 1, bs]; the last entry of each is a scratch target for masked writes)."""

    def __init__(self, num_blocks: int, slots: int, bs: int, sink: int, recent: int, device):
        self.NB, self.S, self.bs, self.sink, self.recent = num_blocks, slots, bs, sink, recent
        self.dmap = torch.full((num_blocks + 1,), -1, dtype=torch.int32, device=device)
        self.owner = torch.full((slots + 1,), -1, dtype=torch.long, device=device)
        self.dvalid = torch.zeros(slots + 1, bs, dtype=torch.uint8, device=device)
        ns, nr = tier_blocks(sink, recent, bs)
        self.ns, self.nr = ns, nr

    def update(self, table: torch.Tensor, seq: torch.Tensor) -> None:
        """Keep / give slots to the blocks holding each request's sink rows and recent window (seq: tokens
        held after this step), release the rest. Pure device ops."""
        R, MB = table.shape
        dev = table.device
        seq = seq.long()
        cols = []
        if self.ns:
            j = torch.arange(self.ns, device=dev)[None].expand(R, self.ns)
            cols.append((j, (j * self.bs < seq[:, None]) & (j * self.bs < self.sink)))
        if self.nr:
            j0 = (seq - self.recent).clamp(min=0) // self.bs
            j = j0[:, None] + torch.arange(self.nr, device=dev)[None]
            cols.append((j, j * self.bs < seq[:, None]))
        j = torch.cat([c[0] for c in cols], 1)
        ok = torch.cat([c[1] for c in cols], 1)
        blocks = table.long().gather(1, j.clamp(max=MB - 1))
        blocks = torch.where(ok & (blocks >= 0) & (blocks < self.NB), blocks, self.NB).reshape(-1)
        own = self.owner[: self.S]
        release = (own >= 0) & ~torch.isin(own, blocks)  # no [num_blocks] temporaries per step
        self.dmap[torch.where(release, own, self.NB)] = -1
        own.masked_fill_(release, -1)
        self.dmap[self.NB] = -1
        n = blocks.numel()
        srt, order = torch.sort(blocks, stable=True)
        first_sorted = torch.ones(n, dtype=torch.bool, device=dev)
        first_sorted[1:] = srt[1:] != srt[:-1]
        first = torch.empty_like(first_sorted)
        first[order] = first_sorted  # the first occurrence of each block (a block two requests share: once)
        new = (blocks < self.NB) & (self.dmap[blocks] < 0) & first
        rank = torch.cumsum(new.long(), 0) - 1
        free_first = torch.argsort((own >= 0).to(torch.int32), stable=True)
        n_free = (own < 0).sum()
        ok_new = new & (rank < n_free)
        slot = free_first[rank.clamp(0, self.S - 1)]
        slot = torch.where(ok_new, slot, self.S)
        self.dmap[torch.where(ok_new, blocks, self.NB)] = slot.to(torch.int32)
        self.owner[slot] = torch.where(ok_new, blocks, -1)
        self.dvalid[slot] = 0
        self.dmap[self.NB] = -1
        self.owner[self.S] = -1
