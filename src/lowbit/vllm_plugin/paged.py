"""Write to and attend over vLLM's paged cache of packed slots (pure torch; the vLLM glue is backend.py).

Cache view: uint8 [num_blocks, H_kv, block_size, slot_bytes] (vLLM's head-major LBHNC layout),
token t of a request lives in block block_table[t // block_size] at offset t % block_size;
`slot_mapping[i] = block * block_size + offset` for each new token (negative = padding, skipped).

`write` encodes the new tokens through SlotFormat.encode (rotate -> lowbit's quantizer -> pack).
The exact tiers: the first `sink` and the last `recent` tokens of every request are also kept
dense (rotated, model dtype) in a TierArena owned by the backend, keyed by the physical block
that holds them, and `attend` reads those rows from it instead of from their codes -- lowbit's
sink and recent tiers (page 1), outside vLLM's block budget ((sink + recent) x KV heads x
(D_k + D_v) x dtype bytes per layer per request).
`attend` runs, per request, exact softmax attention of its new queries over the history stored
before them, read back from the packed cache (and the dense tiers), plus their own chunk as it
arrived (rotated, model dtype) -- lowbit's runtime semantics (QuantizedKVLayer.blocks): a prompt
attends to itself exactly during its prefill, later steps read it as stored. The history streams
`chunk_tokens` tokens at a time through lowbit.kv.attention.online_attention, so a long history
is never dequantized at once.

Sliding-window layers (window W: a query at position p sees keys in (p - W, p], HF's and vLLM's
convention). vLLM frees -- and may hand to another request -- every block whose tokens all lie
before `num_computed_tokens - W + 1`, i.e. before the lowest key the first query of the step can
see (`visible_from`). So for such a layer `attend` reads a request's cache and arena only from
the block holding that position on (never a block vLLM may have freed), the window mask drops
the rows of that first block that are out of reach, and the arena keeps a dense row only while
a future query can still see it. This is lowbit's runtime (QuantizedKVLayer._evict_before): on a
sliding layer the sink tokens are exact while inside the window and not attended once they
leave it, and the recent tier is exact inside the window.
Queries are rotated by R_k, the output is un-rotated by R_v^T. Query head j reads KV head j // G.
"""

from __future__ import annotations

import itertools

import torch

from lowbit.vllm_plugin.slot import SlotFormat

DEFAULT_CHUNK_TOKENS = 1024


class TierArena:
    """Dense copies of the exact tiers of one layer: each request's first `sink` tokens and its last
    `recent` tokens, {block id: (k, v) [H, block_size, D]} in the model dtype, rotated.
    `window`: the layer's sliding window (None: full attention).

    lowbit's runtime with page 1 holds a token dense when its position p < sink or
    p >= seq_len - recent (seq_len: tokens stored after this step), and packed otherwise; so does
    this arena. A row that is dense when read was dense when written (seq_len only grows), so
    `write` stores exactly the rows that satisfy the rule at write time, `attend` reads them back,
    and `evict` drops the blocks of a request that have fallen behind its recent window.
    Entries are keyed by the physical block: a block reused by a later request is overwritten by
    that request's own writes before it reads them. `retain(live)` drops blocks no live request
    needs (finished requests); a row that is missing when read raises instead of being read from
    its codes.
    Sliding window: only rows at positions >= visible_from(first query) are ever read, and a
    request's blocks below that position are never touched (vLLM may have given them to another
    request); `evict` drops what the next query can no longer see.
    """

    def __init__(self, sink: int, recent: int, block_size: int, dtype: torch.dtype, window: int | None = None):
        self.sink, self.recent, self.bs, self.dtype = int(sink), int(recent), int(block_size), dtype
        self.window = int(window) if window else None
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())

    def dense_from(self, seq_len: int) -> int:
        """First position of the recent window when the request holds seq_len tokens."""
        return max(self.sink, seq_len - self.recent) if self.recent else seq_len

    def visible_from(self, q0: int) -> int:
        """Lowest key position a query at position >= q0 can see (0 on a full-attention layer)."""
        return visible_from(q0, self.window)

    def dense_rows(self, lo: int, hi: int, seq_len: int) -> list[int]:
        """Positions in [lo, hi) held dense when the request holds seq_len tokens (sink, recent)."""
        return list(range(lo, min(self.sink, hi))) + list(range(max(lo, self.dense_from(seq_len)), hi))

    def store(self, slots: torch.Tensor, positions: torch.Tensor, seq_lens_of_rows: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """k [T, H, D_k], v [T, H, D_v] rotated; keeps rows with position < sink or in the recent window."""
        sel = (positions < self.sink) | ((positions >= seq_lens_of_rows - self.recent) & (self.recent > 0))
        if not bool(sel.any()):
            return
        ks, vs = k[sel].to(self.dtype), v[sel].to(self.dtype)
        for s, kk, vv in zip(slots[sel].tolist(), ks, vs):
            b, off = divmod(s, self.bs)
            if b not in self.k:
                self.k[b] = torch.zeros(kk.shape[0], self.bs, kk.shape[1], dtype=self.dtype)
                self.v[b] = torch.zeros(vv.shape[0], self.bs, vv.shape[1], dtype=self.dtype)
            self.k[b][:, off] = kk
            self.v[b][:, off] = vv

    def overlay(self, table_row: torch.Tensor, lo: int, seq_len: int, k: torch.Tensor, v: torch.Tensor,
                vis_lo: int = 0):
        """Replace the rows of k/v [1, H, n, D] (positions lo..lo+n) that are dense tiers by their copies.
        Rows before vis_lo (out of every query's window: masked) are left as they are."""
        n = k.shape[2]
        for j in self.dense_rows(max(lo, vis_lo), lo + n, seq_len):
            b, off = int(table_row[j // self.bs]), j % self.bs
            if b not in self.k:
                raise RuntimeError(f"lowbit plugin: the dense copy of position {j} (block {b}) is gone; "
                                   "the request was not scheduled for too long")
            k[0, :, j - lo] = self.k[b][:, off].to(k.dtype)
            v[0, :, j - lo] = self.v[b][:, off].to(v.dtype)
        return k, v

    def needed_blocks(self, table_row: torch.Tensor, seq_len: int, lo: int = 0) -> set[int]:
        """Blocks holding a request's dense rows (sink and recent window) at positions >= lo."""
        return {int(table_row[j // self.bs]) for j in self.dense_rows(lo, seq_len, seq_len)}

    def evict(self, table_row: torch.Tensor, seq_len: int, lo: int = 0) -> None:
        """Drop this request's blocks, from position lo on (the blocks this step could read: vLLM may
        have freed those below), that hold no dense row a future query (at >= seq_len) can see."""
        keep = self.needed_blocks(table_row, seq_len, self.visible_from(seq_len))
        for i in range(lo // self.bs, -(-seq_len // self.bs)):
            b = int(table_row[i])
            if b not in keep:
                self.k.pop(b, None)
                self.v.pop(b, None)

    def retain(self, live: set[int]) -> None:
        """Keep only blocks in `live` (the dense blocks of the requests vLLM is running)."""
        for b in [b for b in self.k if b not in live]:
            del self.k[b], self.v[b]


def visible_from(q0: int, window: int | None) -> int:
    """Lowest key position a query at position >= q0 sees: q0 - (W - 1) for a window W, else 0."""
    return max(0, q0 - (window - 1)) if window else 0


def write(cache_u8: torch.Tensor, fmt: SlotFormat, key: torch.Tensor, value: torch.Tensor,
          slot_mapping: torch.Tensor, rot_k=None, rot_v=None, *, positions: torch.Tensor | None = None,
          row_seq_lens: torch.Tensor | None = None, arena: TierArena | None = None) -> int:
    """Store key [T, H, D_k], value [T, H, D_v] at slot_mapping [T]; returns the tokens written.

    With an arena, `positions` [T] (each token's index in its request) and `row_seq_lens` [T]
    (its request's length after this step) pick the rows also kept dense (TierArena). Every row
    is packed either way: the paged cache holds all tokens."""
    n = min(key.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:n].long()
    keep = slots >= 0
    key, value = key[:n][keep], value[:n][keep]
    if positions is not None:
        positions = positions[:n][keep]
        row_seq_lens = row_seq_lens[:n][keep]
    slots = slots[keep]
    if slots.numel() == 0:
        return 0
    bs = cache_u8.shape[2]
    packed = fmt.encode(key, value, rot_k, rot_v)  # [T, H, C]
    cache_u8[slots // bs, :, slots % bs, :] = packed  # advanced indices first: [T, H, C]
    if arena is not None and (arena.sink > 0 or arena.recent > 0):
        if positions is None or row_seq_lens is None:
            raise ValueError("a tier arena needs the token positions and their requests' lengths")
        from lowbit.kv.rotations import rotate

        kr = rotate(key.transpose(0, 1).unsqueeze(0), rot_k)[0].transpose(0, 1)  # [T, H, D_k] float32
        vr = rotate(value.transpose(0, 1).unsqueeze(0), rot_v)[0].transpose(0, 1)
        arena.store(slots, positions.long(), row_seq_lens.long(), kr, vr)
    return int(slots.numel())


def _blocks(cache_u8, fmt: SlotFormat, table_row: torch.Tensor, seq_len: int, chunk_tokens: int,
            arena: TierArena | None = None, upto: int | None = None, start: int = 0):
    """Yield (k [1,H,n,D], v [1,H,n,Dv], first slot) for one request's stored rows [start, upto),
    chunk by chunk, from the block holding `start` on (blocks before it are never indexed: on a
    sliding layer vLLM may have freed them); seq_len (the request's length after this step)
    decides which rows are dense tiers."""
    bs = cache_u8.shape[2]
    per = max(1, chunk_tokens // bs)  # vLLM blocks per chunk
    upto = seq_len if upto is None else upto
    n_blocks = -(-upto // bs)
    for b0 in range(start // bs, n_blocks, per):
        ids = table_row[b0:min(n_blocks, b0 + per)].long()
        raw = cache_u8[ids]  # [nb, H, bs, C]
        H, C = raw.shape[1], raw.shape[3]
        raw = raw.permute(1, 0, 2, 3).reshape(H, -1, C)  # [H, nb*bs, C]
        lo = b0 * bs
        n = min(upto - lo, raw.shape[1])
        k, v = fmt.decode(raw[:, :n])
        if arena is not None:
            k, v = arena.overlay(table_row, lo, seq_len, k, v, vis_lo=start)
        yield k, v, lo


def attend(query: torch.Tensor, cache_u8: torch.Tensor, fmt: SlotFormat, *, block_table: torch.Tensor,
           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, rot_k=None, rot_v=None,
           window: int | None = None, softcap: float | None = None,
           chunk_tokens: int = DEFAULT_CHUNK_TOKENS, arena: TierArena | None = None,
           new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D] (the batch's new tokens, request after request) -> output [T, Hq, D_v] float32.

    seq_lens [R]: tokens each request holds after this step (its new ones included);
    query_start_loc [R + 1]: where each request's queries start in `query`;
    new_k [T, Hkv, D], new_v: the new tokens' K/V as they arrived -- their own chunk is attended
    exactly (lowbit's runtime); without them it is read back from the cache like the history.
    window: the layer's sliding window; the history is read from visible_from(first query) on.
    """
    from lowbit.kv.attention import online_attention
    from lowbit.kv.rotations import rotate, unrotate

    T, Hq, D = query.shape
    Hkv = cache_u8.shape[1]
    G = Hq // Hkv
    Dv = fmt.codecs["v"].head_dim
    if arena is not None and (arena.window or None) != (window or None):
        raise ValueError(f"the tier arena is for window {arena.window}, the attention for {window}")
    out = torch.zeros(T, Hq, Dv, dtype=torch.float32, device=query.device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        q0, q1 = qsl[r], qsl[r + 1]
        lq = q1 - q0
        if lq == 0 or seq_len == 0:
            continue
        # [lq, Hq, D] -> [1, Hkv, G*lq, D] (query head j = kv head j // G), rotated like the stored keys
        q = query[q0:q1].float().reshape(lq, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hkv, G * lq, D)
        q = rotate(q, rot_k).reshape(1, Hkv, G, lq, D)
        q_slots = torch.arange(seq_len - lq, seq_len, device=query.device)
        vis = visible_from(seq_len - lq, window)
        if new_k is None:
            blocks = _blocks(cache_u8, fmt, block_table[r], seq_len, chunk_tokens, arena, start=vis)
        else:
            ck = rotate(new_k[q0:q1].transpose(0, 1).unsqueeze(0), rot_k).to(new_k.dtype)  # [1, Hkv, lq, D]
            cv = rotate(new_v[q0:q1].transpose(0, 1).unsqueeze(0), rot_v).to(new_v.dtype)
            hist = _blocks(cache_u8, fmt, block_table[r], seq_len, chunk_tokens, arena, upto=seq_len - lq,
                           start=vis)
            blocks = itertools.chain(hist, [(ck, cv, seq_len - lq)])
        o = online_attention(q, blocks, q_slots, scaling=scale, window=window, softcap=softcap)  # [1,Hkv,G,lq,Dv]
        o = unrotate(o.reshape(1, Hkv, G * lq, Dv), rot_v).reshape(Hkv, G, lq, Dv)
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(lq, Hq, Dv)
        if arena is not None:
            arena.evict(block_table[r], seq_len, vis)
    return out


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of each of the batch's n new tokens in its request: seq_len - q_len + i, and that
    request's seq_len), -1 / 0 for padding tokens."""
    qsl = query_start_loc.long().cpu()
    q_lens = qsl[1:] - qsl[:-1]
    starts = seq_lens.long().cpu() - q_lens  # position of each request's first new token
    req = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    pos = starts[req] + (torch.arange(int(q_lens.sum())) - qsl[:-1][req])
    out = torch.full((n,), -1, dtype=torch.long)
    out[: min(n, pos.numel())] = pos[:n]
    lens = torch.zeros(n, dtype=torch.long)
    lens[: min(n, pos.numel())] = seq_lens.long().cpu()[req][:n]
    return out, lens
