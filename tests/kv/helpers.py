"""Tiny models and reference runs shared by the KV-cache tests."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models.tiny import tiny_config


def make_model(name: str, num_layers: int | None = None, seed: int = 0, **overrides):
    """Random-weight tiny model of a built-in (vocab 99), config fields overridden before the
    model is built (e.g. sliding_window=11, num_attention_heads=6, num_key_value_heads=2)."""
    cfg = tiny_config(name, num_layers, vocab_size=99)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.float().eval()


# Fast variants of the built-ins: gemma3 with 1 sliding (window 11) + 1 full layer, so eviction
# happens within a few dozen tokens; smollm2 with its 2 default (full) layers.
FAST = {
    "smollm2-135m": {},
    "gemma3-270m": {"num_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 11},
}


def fast_model(name: str, seed: int = 0, **overrides):
    return make_model(name, seed=seed, **{**FAST[name], **overrides})


def scheme(name: str = "bf16", **kw):
    """parse_kv_scheme(name) with small tiers so that short tests exercise all of them."""
    base = {"sink": 4, "recent": 8, "page": 4}
    base.update(kw)
    rest = {k: base.pop(k) for k in list(base) if k not in ("sink", "recent", "page")}
    s = parse_kv_scheme(name, **{k: v for k, v in rest.items() if k in ("group", "clip", "lloyd_max", "rotation", "grid", "layer_bits",
                                                                   "zero")})
    return replace(s, sink=base["sink"], recent=base["recent"], page=base["page"])


def positions(mask: torch.Tensor) -> torch.Tensor:
    """HF position ids of a left-padded batch: 0 at the first real token."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


@torch.no_grad()
def run_chunks(model, cache, ids, mask, chunks, impl=None):
    """Feed ids [B, L] through `cache` in chunks (sizes summing to L) -> logits [B, L, V]."""
    if impl is not None:
        model.set_attn_implementation(impl)
    assert sum(chunks) == ids.shape[1]
    outs, pos = [], 0
    for c in chunks:
        m = mask[:, : pos + c] if mask is not None else None
        kw = {}
        if m is not None:
            kw = {"attention_mask": m, "position_ids": positions(m)[:, pos : pos + c]}
        outs.append(model(ids[:, pos : pos + c], past_key_values=cache, use_cache=True, **kw).logits)
        pos += c
    return torch.cat(outs, 1)


def reference(model, ids, mask, chunks):
    """The same run through DynamicCache with SDPA attention."""
    return run_chunks(model, DynamicCache(config=model.config), ids, mask, chunks, impl="sdpa")


def rel_err(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """max |a - b| / max |b| over valid positions [B, L] (all when None)."""
    if valid is not None:
        a, b = a[valid.bool()], b[valid.bool()]
    return float((a - b).abs().max() / b.abs().max())
