"""Write to and attend over vLLM's paged cache of packed slots (pure torch; the vLLM glue is backend.py).

Cache view: uint8 [num_blocks, H_kv, block_size, slot_bytes] (vLLM's head-major LBHNC layout),
token t of a request lives in block block_table[t // block_size] at offset t % block_size;
`slot_mapping[i] = block * block_size + offset` for each new token (negative = padding, skipped).

`write` encodes the new tokens through SlotFormat.encode (rotate -> lowbit's quantizer -> pack).
`attend` runs, per request, exact softmax attention of its new queries over its whole history
read back from the packed cache -- the new tokens included, already quantized, exactly like
lowbit's own cache with sink 0 / recent 0 / page 1 -- streaming `chunk_tokens` tokens at a time
through lowbit.kv.attention.online_attention, so a long history is never dequantized at once.
Queries are rotated by R_k, the output is un-rotated by R_v^T. Query head j reads KV head j // G.
"""

from __future__ import annotations

import torch

from lowbit.vllm_plugin.slot import SlotFormat

DEFAULT_CHUNK_TOKENS = 1024


def write(cache_u8: torch.Tensor, fmt: SlotFormat, key: torch.Tensor, value: torch.Tensor,
          slot_mapping: torch.Tensor, rot_k=None, rot_v=None) -> int:
    """Store key [T, H, D_k], value [T, H, D_v] at slot_mapping [T]; returns the tokens written."""
    n = min(key.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:n].long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
    else:
        key, value = key[:n], value[:n]
    if slots.numel() == 0:
        return 0
    bs = cache_u8.shape[2]
    packed = fmt.encode(key, value, rot_k, rot_v)  # [T, H, C]
    cache_u8[slots // bs, :, slots % bs, :] = packed  # advanced indices first: [T, H, C]
    return int(slots.numel())


def _blocks(cache_u8, fmt: SlotFormat, table_row: torch.Tensor, seq_len: int, chunk_tokens: int):
    """Yield (k [1,H,n,D], v [1,H,n,Dv], first slot) for one request's history, chunk by chunk."""
    bs = cache_u8.shape[2]
    per = max(1, chunk_tokens // bs)  # vLLM blocks per chunk
    n_blocks = -(-seq_len // bs)
    for b0 in range(0, n_blocks, per):
        ids = table_row[b0:min(n_blocks, b0 + per)].long()
        raw = cache_u8[ids]  # [nb, H, bs, C]
        H, C = raw.shape[1], raw.shape[3]
        raw = raw.permute(1, 0, 2, 3).reshape(H, -1, C)  # [H, nb*bs, C]
        lo = b0 * bs
        n = min(seq_len - lo, raw.shape[1])
        k, v = fmt.decode(raw[:, :n])
        yield k, v, lo


def attend(query: torch.Tensor, cache_u8: torch.Tensor, fmt: SlotFormat, *, block_table: torch.Tensor,
           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, rot_k=None, rot_v=None,
           window: int | None = None, softcap: float | None = None,
           chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """query [T, Hq, D] (the batch's new tokens, request after request) -> output [T, Hq, D_v] float32.

    seq_lens [R]: tokens each request holds after this step (its new ones included);
    query_start_loc [R + 1]: where each request's queries start in `query`.
    """
    from lowbit.kv.attention import online_attention
    from lowbit.kv.rotations import rotate, unrotate

    T, Hq, D = query.shape
    Hkv = cache_u8.shape[1]
    G = Hq // Hkv
    Dv = fmt.codecs["v"].head_dim
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
        o = online_attention(q, _blocks(cache_u8, fmt, block_table[r], seq_len, chunk_tokens), q_slots,
                             scaling=scale, window=window, softcap=softcap)  # [1, Hkv, G, lq, Dv]
        o = unrotate(o.reshape(1, Hkv, G * lq, Dv), rot_v).reshape(Hkv, G, lq, Dv)
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(lq, Hq, Dv)
    return out
