"""Model-family hooks the lowbit cache needs beyond the "lowbit" attention function.

DeepseekV3 (MLA). transformers' DeepseekV3Attention hands the cache what its version caches:
5.24 the latent (c_kv [B, 1, T, 512], k_pe [B, 1, T, 64]) then expands it per head; 5.17 the
expanded per-head K [B, H, T, 192] / V [B, H, T, 128]. lowbit replaces the module's forward
(only while a QuantizedKVCache is passed; any other cache runs transformers' own forward) so the
layout is the one the plan's geometry names, on both versions:
    storage "mha" (expanded):  K = [k_nope | k_pe] per head (qk_nope + qk_rope), V per head
                               (v_head_dim); plain MHA attention through the cache's tiers.
    storage "mla-latent":      K = [c_kv | k_pe] (one head), V = c_kv; the query absorbs W_uk
                               (q_lat = q_nope W_uk, per head [nope] -> [rank]) and the output absorbs
                               W_uv (o = P c_kv W_uv^T): MQA over a 576-wide key and a 512-wide value.
The absorbed products run in float32 (the latent query and output are rank-wide sums).

Gemma-4 K = V layers (attention_k_eq_v): transformers computes K = RoPE(k_norm(x)) and
V = v_norm(x) from one projection x, so outside K's RoPE'd dims K = V x k_norm.weight. The
layer stores V and K's RoPE'd dims only (lowbit.kv.layer, shared K/V); this module hands each such
layer its k_norm scale, checked against the module (k_norm(x) == v_norm(x) * scale) so a norm with
another convention is refused instead of rebuilding a wrong K.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch

from lowbit.backends.torch_stream import lowbit_attention
from lowbit.core.errors import LowbitError

_CACHE_NAMES = ("cache", "past_key_values", "past_key_value")


def install(model, cache) -> None:
    """Prepare `model` for `cache` (a QuantizedKVCache): MLA forwards, K = V scales. Idempotent per model."""
    geometry = cache.geometry
    if any(getattr(g, "storage", "mha") == "mla-latent" for g in geometry.layers) or \
            getattr(model.config, "model_type", None) == "deepseek_v3" or _has_mla(model):
        _install_mla(model, type(cache))
    if any(getattr(g, "k_eq_v", False) for g in geometry.layers):
        _attach_k_scales(model, cache)


# ------------------------------------------------------------------ DeepseekV3
def _is_mla(m) -> bool:
    return hasattr(m, "kv_b_proj") and hasattr(m, "kv_a_proj_with_mqa") and hasattr(m, "layer_idx")


def _has_mla(model) -> bool:
    return any(_is_mla(m) for m in model.modules())


def _install_mla(model, cache_type) -> None:
    """Replace each MLA module's forward; the replacement takes the lowbit path only for a `cache_type`
    cache (the class of the cache that installed it), transformers' own forward for any other."""
    for m in model.modules():
        if _is_mla(m):
            m._lowbit_cache_type = cache_type
        if _is_mla(m) and not getattr(m, "_lowbit_mla", False):
            orig = m.forward
            params = inspect.signature(orig).parameters
            name = next((n for n in _CACHE_NAMES if n in params), "past_key_values")
            m._lowbit_orig_forward, m._lowbit_cache_name = orig, name
            m.forward = types.MethodType(_mla_forward, m)
            m._lowbit_mla = True


def _rope_fns(m):
    mod = sys.modules[type(m).__module__]
    return mod.apply_rotary_pos_emb_interleave, mod.apply_rotary_pos_emb


def mla_project(self, hidden_states, position_embeddings):
    """A DeepseekV3Attention's projections of hidden_states [B, T, hidden] -> q_nope [B, H, T, nope],
    q_pe [B, H, T, rope] (RoPE'd), the latent c_kv [B, 1, T, rank] (after kv_a_layernorm: what the
    latent cache stores) and k_pe [B, 1, T, rope] (RoPE'd)."""
    B, T = hidden_states.shape[:2]
    H, nope, rope, rank = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    if getattr(self, "q_lora_rank", None) is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(B, T, H, nope + rope).transpose(1, 2)  # [B, H, T, nope + rope]
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    c, k_pe = torch.split(self.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    c = self.kv_a_layernorm(c).view(B, 1, T, rank)  # the latent c_kv, one "head"
    k_pe = k_pe.view(B, 1, T, rope)
    cos, sin = position_embeddings
    interleave, plain = _rope_fns(self)
    q_pe, k_pe = (interleave if self.config.rope_interleave else plain)(q_pe, k_pe, cos, sin)
    return q_nope, q_pe, c, k_pe


def mla_latent_qkv(self, q_nope, q_pe, c, k_pe):
    """The absorbed (latent) attention inputs from mla_project's outputs: query float32 [B, H, T, rank + rope]
    (q_nope W_uk | q_pe), key [B, 1, T, rank + rope] ([c_kv | k_pe]), value [B, 1, T, rank] (c_kv), and
    kv_b_proj's weight float32 [H, nope + dv, rank] (its rows nope.. give W_uv for the output)."""
    H, nope, rank, dv = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank, self.v_head_dim
    w = self.kv_b_proj.weight.float().view(H, nope + dv, rank)  # [H, nope + dv, rank]
    q_lat = torch.einsum("bhtn,hnr->bhtr", q_nope.float(), w[:, :nope])  # [B, H, T, rank]
    query = torch.cat([q_lat, q_pe.float()], dim=-1)  # [B, H, T, rank + rope], float32
    return query, torch.cat([c, k_pe], dim=-1), c, w


def _mla_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    """DeepseekV3Attention.forward with the lowbit cache (see the module docstring); [B, T, hidden], None."""
    cache = None
    for n in _CACHE_NAMES:
        if n in kwargs:
            cache = kwargs.pop(n) if cache is None else (kwargs.pop(n) or cache)
    if not isinstance(cache, self._lowbit_cache_type):
        kwargs[self._lowbit_cache_name] = cache
        return self._lowbit_orig_forward(hidden_states, position_embeddings=position_embeddings,
                                         attention_mask=attention_mask, *args, **kwargs)
    B, T = hidden_states.shape[:2]
    H, nope, rope, rank, dv = (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank,
                               self.v_head_dim)
    q_nope, q_pe, c, k_pe = mla_project(self, hidden_states, position_embeddings)

    storage = cache.layers[self.layer_idx].geometry.storage
    if storage == "mla-latent":
        query, key, value, w = mla_latent_qkv(self, q_nope, q_pe, c, k_pe)
        key, value = cache.update(key, value, self.layer_idx)
        o_lat, _ = lowbit_attention(self, query, key, value, attention_mask, scaling=self.scaling)  # [B, T, H, rank]
        out = torch.einsum("bthr,hvr->bthv", o_lat.float(), w[:, nope:])  # [B, T, H, dv]
    elif storage == "mha":
        kv = self.kv_b_proj(c.view(B, T, rank)).view(B, T, H, nope + dv).transpose(1, 2)
        k_nope, value = torch.split(kv, [nope, dv], dim=-1)  # [B, H, T, nope], [B, H, T, dv]
        key = torch.cat([k_nope, k_pe.expand(B, H, T, rope)], dim=-1)  # [B, H, T, nope + rope]
        query = torch.cat([q_nope, q_pe], dim=-1)
        key, value = cache.update(key, value, self.layer_idx)
        out, _ = lowbit_attention(self, query, key, value, attention_mask, scaling=self.scaling)  # [B, T, H, dv]
    else:
        raise LowbitError(f"layer {self.layer_idx}: MLA cache storage {storage!r} unknown (mha | mla-latent)")
    out = out.to(hidden_states.dtype).reshape(B, T, H * dv)
    return self.o_proj(out), None


# ------------------------------------------------------------------ Gemma-4 K = V
def _attach_k_scales(model, cache) -> None:
    mods = {int(m.layer_idx): m for m in model.modules()
            if hasattr(m, "layer_idx") and hasattr(m, "k_norm") and hasattr(m, "q_proj")}
    for layer in cache.layers:
        g = layer.geometry
        if not getattr(g, "k_eq_v", False):
            continue
        m = mods.get(g.index)
        if m is None or getattr(m, "v_norm", None) is None:
            raise LowbitError(f"layer {g.index} is K = V in the config but no attention module with k_norm / v_norm "
                              "was found; this Gemma-4 variant is not supported")
        scale = _k_norm_scale(m.k_norm, m.v_norm, g.head_dim_k, g.index)
        layer.k_scale_v = scale


@torch.no_grad()
def _k_norm_scale(k_norm, v_norm, d: int, index: int) -> torch.Tensor:
    """float32 [d] s with k_norm(x) == v_norm(x) * s, checked on a random probe."""
    w = getattr(k_norm, "weight", None)
    if w is None:
        return torch.ones(d)
    s = w.detach().float().cpu()
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(index), dtype=torch.float32).to(w.device)
    lhs = k_norm(x.to(w.dtype)).float()
    rhs = v_norm(x.to(w.dtype)).float() * s.to(w.device)
    if not torch.allclose(lhs, rhs, rtol=1e-2, atol=1e-3):
        raise LowbitError(f"layer {index}: k_norm is not v_norm times a per-channel weight, so K cannot be rebuilt "
                          "from the stored V; this Gemma-4 variant is not supported")
    return s
