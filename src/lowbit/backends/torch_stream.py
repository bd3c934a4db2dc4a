"""The attention that reads a QuantizedKVCache's tiers, registered in transformers as "lowbit".

How the cache reaches the attention function: transformers calls `cache.update(k, v, layer_idx)`
and then `attention_interface(module, q, k_returned, v_returned, mask, ...)` in the same layer
forward, but does not hand the cache to the attention function (5.17 and 5.24 alike). So
`QuantizedKVLayer.update` leaves a hand-off in a thread-local slot -- (cache, layer index, the
exact key/value tensors it returned) -- and `lowbit_attention` takes it when it is called with
those very tensors (identity, not equality). Without a matching hand-off (DynamicCache, no cache)
"lowbit" is plain exact attention over the keys it is given, so a model switched to "lowbit"
still works with any other cache.

Masks: "lowbit" registers a mask function (`lowbit_mask`) that passes the user's 2-D
attention_mask [B, past + new] (bool, or None) through unchanged (a custom attention without one
would get None and lose padding); the tiers build causal, sliding-window and padding masks from
absolute slot indices (a slot = a column of that mask).

The math (`online_attention`): keys arrive in blocks -- sink, the middle dequantized
`chunk_tokens` rows at a time, recent -- and are merged with an online softmax (running max and
sum in float32), so the decode path never holds the whole history in high precision. GQA/MQA:
the G query heads of a KV head are stacked as rows ([B, Hkv, G*Lq, D] @ [B, Hkv, D, N]), no
repeat_interleave copies. Query head j reads KV head j // G (transformers' repeat_kv order).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from lowbit import backends as registry
from lowbit.core.errors import LowbitError

ATTENTION_NAME = "lowbit"
_slot = threading.local()


# ------------------------------------------------------------------ hand-off
def post_handoff(cache, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Called by the cache's update(): the next lowbit_attention call with (key, value) reads its tiers."""
    _slot.pending = (cache, layer_idx, key, value)


def take_handoff(key: torch.Tensor, value: torch.Tensor):
    """(cache, layer_idx) when (key, value) are the tensors a lowbit cache's update() just returned."""
    p = getattr(_slot, "pending", None)
    if p is None or p[2] is not key or p[3] is not value:
        return None
    _slot.pending = None
    return p[0], p[1]


# ------------------------------------------------------------------ masks
def padding_keep(attention_mask, n_total: int, device) -> torch.Tensor | None:
    """The user's 2-D mask [B, n_total] as bool keep-mask (None: no padding). Refuses 4-D masks."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = getattr(attention_mask, "shape", type(attention_mask).__name__)
        raise LowbitError(
            f"the lowbit KV cache needs the 2-D attention_mask [batch, tokens] (or None), got {tuple(shape) if not isinstance(shape, str) else shape}; "
            "pass the tokenizer's attention_mask instead of a prepared 4-D mask"
        )
    if attention_mask.shape[-1] != n_total:
        raise LowbitError(
            f"attention_mask covers {attention_mask.shape[-1]} tokens but the cache holds {n_total} (past + new); "
            "pass the mask of the whole sequence so far"
        )
    keep = attention_mask.to(device=device) != 0
    return None if bool(keep.all()) else keep


def block_mask(
    k_lo: int, n: int, q_slots: torch.Tensor, window: int | None, keep: torch.Tensor | None
) -> torch.Tensor:
    """Allowed [B|1, 1, 1, Lq, n] for keys at slots [k_lo, k_lo + n) and queries at q_slots [Lq].

    causal: key slot <= query slot; sliding: key slot > query slot - window (HF's convention:
    a query sees itself and the window - 1 before it); padding: keep[b, key slot].
    """
    ks = torch.arange(k_lo, k_lo + n, device=q_slots.device)
    ok = ks[None, :] <= q_slots[:, None]  # [Lq, n]
    if window is not None:
        ok = ok & (ks[None, :] > q_slots[:, None] - window)
    ok = ok[None, None, None]  # [1,1,1,Lq,n]
    if keep is not None:
        ok = ok & keep[:, k_lo : k_lo + n][:, None, None, None, :]
    return ok


# ------------------------------------------------------------------ math
def online_attention(
    q: torch.Tensor,
    blocks: Iterable[tuple[torch.Tensor, torch.Tensor, int]],
    q_slots: torch.Tensor,
    *,
    scaling: float,
    window: int | None = None,
    keep: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact softmax attention over key/value blocks, merged online in float32.

    q [B, Hkv, G, Lq, D] (already rotated); blocks yield (k [B, Hkv, n, D], v [B, Hkv, n, Dv],
    slot of the block's first key); q_slots [Lq] absolute query slots. Returns [B, Hkv, G, Lq, Dv]
    float32; rows that see no key (fully masked, e.g. a padding query) return 0, never NaN.
    """
    B, Hkv, G, Lq, D = q.shape
    qf = (q.float() * scaling).reshape(B, Hkv, G * Lq, D)
    m = torch.full((B, Hkv, G, Lq), float("-inf"), device=q.device)
    l = torch.zeros((B, Hkv, G, Lq), device=q.device)
    acc = None
    for k, v, lo in blocks:
        n = k.shape[-2]
        if n == 0:
            continue
        s = torch.matmul(qf, k.float().transpose(-1, -2)).view(B, Hkv, G, Lq, n)
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~block_mask(lo, n, q_slots, window, keep), float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_use = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))  # guard all -inf rows
        p = torch.exp(s - m_use.unsqueeze(-1))
        alpha = torch.exp(m - m_use)  # exp(-inf) = 0 on the first block that sees a key
        pv = torch.matmul(p.view(B, Hkv, G * Lq, n), v.float()).view(B, Hkv, G, Lq, -1)
        acc = pv if acc is None else acc * alpha.unsqueeze(-1) + pv
        l = l * alpha + p.sum(-1)
        m = m_new
    if acc is None:
        raise LowbitError("attention over an empty cache: no keys were stored for this layer")
    return torch.where(l.unsqueeze(-1) > 0, acc / l.clamp_min(1e-30).unsqueeze(-1), torch.zeros_like(acc))


def dense_attention(module, query, key, value, attention_mask, scaling, sliding_window=None, softcap=None):
    """"lowbit" without a lowbit cache: exact attention over the given keys, which end at the queries
    (DynamicCache, sliding DynamicCache, or no cache), through torch SDPA. Returns [B, Lq, Hq, Dv]."""
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        mask = attention_mask[..., -Lk:]  # someone prepared a 4-D mask (additive or bool): use it as is
    else:
        keep = None
        if attention_mask is not None:
            if attention_mask.shape[-1] < Lk:
                raise LowbitError(f"attention_mask covers {attention_mask.shape[-1]} tokens but there are {Lk} keys")
            keep = attention_mask[:, -Lk:].to(query.device) != 0
        q_slots = torch.arange(Lk - Lq, Lk, device=query.device)
        if softcap:  # SDPA has no logit soft-capping: use the online path
            q5 = query.reshape(B, Hkv, Hq // Hkv, Lq, D)
            out = online_attention(
                q5, [(key, value, 0)], q_slots, scaling=scaling, window=sliding_window, keep=keep, softcap=softcap
            )
            return out.reshape(B, Hq, Lq, -1).transpose(1, 2).to(query.dtype).contiguous()
        mask = block_mask(0, Lk, q_slots, sliding_window, keep)[:, :, 0]  # [B|1, 1, Lq, Lk]
        mask = mask | ~mask.any(-1, keepdim=True)  # rows that see nothing (padding queries): avoid NaN
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=Hq != Hkv
    )
    return out.transpose(1, 2).contiguous()


def lowbit_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """transformers attention function (AttentionInterface signature). Returns ([B, Lq, Hq, Dv], None)."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if softcap is None:
        softcap = getattr(module, "attn_logit_softcapping", None)
    h = take_handoff(key, value)
    if h is None and kwargs.get("cu_seq_lens_q") is not None:
        raise LowbitError("the lowbit attention got packed sequences (cu_seqlens, e.g. a vision tower): it has no "
                          "varlen path; keep that sub-model on its own attention implementation")
    if h is None:
        if sliding_window is None:
            sliding_window = getattr(module, "sliding_window", None)
        return dense_attention(module, query, key, value, attention_mask, scaling, sliding_window, softcap), None
    cache, layer_idx = h
    mod_idx = getattr(module, "layer_idx", layer_idx)
    if mod_idx != layer_idx:
        raise LowbitError(f"internal: attention of layer {mod_idx} received the cache hand-off of layer {layer_idx}")
    return cache.attend(layer_idx, query, attention_mask, scaling=scaling, softcap=softcap), None


def lowbit_mask(*args, attention_mask=None, kv_length=None, q_offset=None, **kwargs):
    """transformers mask-interface function for "lowbit": the 2-D padding mask as given (or None).

    Causal and sliding-window structure is built by the attention from slot indices. A static cache
    (its length a device tensor, q_offset; kv_length its capacity; lowbit.runtime.generate.GenerateCache)
    gets the mask padded with ones to kv_length: slots past the sequence are masked by the attention
    itself, and a fixed-shape mask keeps a compiled decode step from retracing as the mask grows by one
    each step (transformers 5.17 passes generate's 2-D mask to every step). Other caches (int lengths)
    get the mask unchanged, so a mask of the wrong length is still refused by the attention."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
        return attention_mask  # a prepared 4-D mask: the attention refuses it with a clear error
    if (isinstance(attention_mask, torch.Tensor) and isinstance(q_offset, torch.Tensor) and isinstance(kv_length, int)
            and kv_length > attention_mask.shape[-1]):
        pad = attention_mask.new_ones(attention_mask.shape[0], kv_length - attention_mask.shape[-1])
        return torch.cat([attention_mask, pad], -1)
    return attention_mask


def register() -> None:
    """Register "lowbit" in transformers' AttentionInterface and mask interface (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, lowbit_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, lowbit_mask)


def install_attention(model) -> None:
    """Make `model` (and its sub-models) use the "lowbit" attention. Exact with any other cache too."""
    register()
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise LowbitError(f"cannot install lowbit attention on a {type(model).__name__}: it has no config")
    if getattr(cfg, "_attn_implementation", None) == ATTENTION_NAME:
        return
    towers = _vision_towers(model)
    before = {id(t): getattr(t.config, "_attn_implementation", None) for t in towers}
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    for t in towers:  # a vision tower has no KV cache and packs images by cu_seqlens: it keeps its attention
        if before[id(t)] and before[id(t)] != ATTENTION_NAME and hasattr(t, "set_attn_implementation"):
            t.set_attn_implementation(before[id(t)])
    if getattr(cfg, "_attn_implementation", None) != ATTENTION_NAME:
        raise LowbitError(
            f"{type(model).__name__} did not accept the lowbit attention implementation; "
            "it must dispatch attention through transformers' AttentionInterface"
        )


_VISION_ATTRS = ("visual", "vision_tower", "vision_model", "vision_encoder")


def _vision_towers(model) -> list:
    """The vision sub-models of a VLM (Qwen2.5-VL `model.visual`, LLaVA-style `vision_tower`, ...)."""
    out = []
    for holder in (model, getattr(model, "model", None)):
        for name in _VISION_ATTRS:
            t = getattr(holder, name, None) if holder is not None else None
            if isinstance(t, torch.nn.Module) and getattr(t, "config", None) is not None and t not in out:
                out.append(t)
    return out


# ------------------------------------------------------------------ backend
def stream_layer(layer, qg: torch.Tensor, keep, scaling: float, softcap=None) -> torch.Tensor:
    """The torch reference over a QuantizedKVLayer: qg [B, Hkv, G, Lq, D] rotated queries of the chunk
    just stored -> [B, Hkv, G, Lq, Dv] float32 (the middle streamed chunk_tokens rows at a time)."""
    Lq = qg.shape[3]
    if Lq > 1 and layer.n == Lq and keep is None and not softcap:
        return first_chunk_attention(layer, qg, scaling)
    q_slots = torch.arange(layer.n - Lq, layer.n, device=qg.device)
    min_slot = layer.n - Lq - (layer.window - 1) if layer.window else 0
    return online_attention(qg, layer.blocks(min_slot), q_slots, scaling=scaling, window=layer.window, keep=keep,
                            softcap=softcap)


def first_chunk_attention(layer, qg: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of a prefill chunk that is the whole history (nothing stored before it, no padding,
    no soft-capping): its queries read only the chunk's own exact K/V, so this is plain causal (or
    sliding) attention and goes through torch SDPA in the model dtype, as transformers runs it. Why: the online
    path materialises [G*Lq, block] scores, masks and exps per block; on a 3,000-token prompt it made
    `lowbit generate`'s prefill ~3x slower than transformers' SDPA on CPU, and a 30k-token prompt
    needed tens of GB. Returns [B, Hkv, G, Lq, Dv] float32 like stream_layer."""
    B, Hkv, G, Lq, D = qg.shape
    ck, cv, lo = layer.chunk
    if lo != 0:
        raise LowbitError(f"layer {layer.layer_idx}: first-chunk attention on a chunk at slot {lo}")
    # in the dtype the chunk is held in (the model's), as transformers' SDPA attention runs (its kernels
    # accumulate in float32): a bf16 prefill cast to float32 lost the CPU's bf16 units
    dt = ck.dtype
    k = layer.full_k(ck, cv).to(dt)
    q = qg.to(dt).reshape(B, Hkv * G, Lq, D)  # query head h*G + g reads KV head h: SDPA's enable_gqa order
    if layer.window is not None and layer.window < Lq:
        q_slots = torch.arange(Lq, device=qg.device)
        mask = block_mask(0, Lq, q_slots, layer.window, None)[:, :, 0]  # [1, 1, Lq, Lq]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, cv.to(dt), attn_mask=mask, scale=scaling,
                                                               enable_gqa=G > 1)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, cv.to(dt), is_causal=True, scale=scaling,
                                                               enable_gqa=G > 1)
    return out.float().reshape(B, Hkv, G, Lq, -1)


def _stream_supports(layer, step: str, device: str) -> str | None:
    return None  # the reference reads every tier the cache can hold (any bits, axis, grid, levels)


BACKEND = registry.register(registry.Backend("torch-stream", ("prefill", "decode"), _stream_supports, stream_layer, module=__name__))
