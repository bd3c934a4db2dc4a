"""Calibration capture of an MLA latent (DeepseekV3 cached as "mla-latent"): what the cache stores, not what
transformers' attention function sees.

transformers' DeepseekV3Attention hands its attention function the *expanded* per-head q/k/v (K 192 /
V 128 x H heads), so the AttentionInterface capture (capture.py) would fit rotations for a cache lowbit
does not hold when the plan stores the latent. For those layers this module reports the latent instead:
a forward pre-hook on each MLA module recomputes, from the same hidden states and position embeddings,
    query  float32 [B, H, T, rank + rope]   (q_nope W_uk | q_pe), the absorbed query
    key    [B, 1, T, rank + rope]           ([c_kv | k_pe]), one shared head
    value  [B, 1, T, rank]                  c_kv after kv_a_layernorm (what the latent cache quantizes)
(lowbit.runtime.families' own projections, so calibration and serving share one definition of the latent) and
calls the observer with them; the expanded call that follows from the same module is dropped. The model's
outputs are transformers' own, unchanged. Scores q·k equal the expanded ones (absorption is exact), so the
attention-weighted statistics (pv) are those of the real attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lowbit.core.errors import LowbitError
from lowbit.runtime.families import _is_mla, mla_latent_qkv, mla_project


def latent_layers(geometry) -> set[int]:
    """Indices of the layers `geometry` stores as an MLA latent."""
    return {g.index for g in geometry.layers if getattr(g, "storage", "mha") == "mla-latent"}


@contextlib.contextmanager
def latent_capture(model, observer, layers: set[int]) -> Iterator:
    """Within the block, the MLA modules of `layers` report their latent q/k/v to `observer` (see module
    docstring). Yields the observer to hand capture_attention: it drops those modules' expanded calls."""
    mods = [m for m in model.modules() if _is_mla(m) and int(m.layer_idx) in layers]
    if len(mods) != len(layers):
        raise LowbitError(f"the geometry stores {len(layers)} MLA latent layers but the model has {len(mods)} MLA "
                          "attention modules there: calibrate with the model the geometry came from")
    ids = {id(m) for m in mods}

    def pre(mod, args, kwargs):
        hs = args[0] if args else kwargs["hidden_states"]
        with torch.no_grad():
            q_nope, q_pe, c, k_pe = mla_project(mod, hs, kwargs["position_embeddings"])
            query, key, value, _ = mla_latent_qkv(mod, q_nope, q_pe, c, k_pe)
        observer(mod, query, key, value, kwargs.get("attention_mask"), float(mod.scaling), None)

    def expanded(module, *a, **k):
        if id(module) in ids:
            return None  # reported as a latent by the pre-hook
        return observer(module, *a, **k)

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in mods]
    try:
        yield expanded
    finally:
        for h in handles:
            h.remove()
