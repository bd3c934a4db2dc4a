"""Capture post-RoPE Q, K, V of every attention layer through transformers' AttentionInterface.

Why the attention function and not forward hooks: the attention function is the one place every
architecture hands over the query/key/value states *after* RoPE (and after Gemma's q/k norms),
as q [B, Hq, T, D], k/v [B, Hkv, T, D] with the KV heads not yet repeated. A forward hook on
k_proj would see pre-RoPE, pre-norm states, which are not what the cache quantizes.

`capture_attention(model, observer)` is a context manager: it registers a capturing attention
implementation (and the matching sdpa mask builder), switches the model to it, and restores the
previous implementation on exit. The capturing function calls `observer(module, q, k, v, mask,
scaling, softcap)` and then plain sdpa, so the model's outputs are unchanged -- unless the
observer returns a tensor [B, T, Hq, Dv], which then replaces the attention output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lowbit.core.errors import LowbitError

try:  # transformers >= 5: masks are built per attention implementation
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError:  # pragma: no cover - older transformers
    AttentionMaskInterface = None
    sdpa_mask = None

CAPTURE_IMPL = "lowbit_capture"

# observer(module, query [B,Hq,T,D], key [B,Hkv,T,D], value [B,Hkv,T,Dv], allowed [B|1,1|H,T,S] bool or None,
#          scaling float, softcap float|None)
Observer = Callable[..., None]

# The active observer. A module-level slot (not a closure per registration) so that registering the
# implementation once is enough and nested/parallel contexts fail loudly instead of mixing streams.
_ACTIVE: list[Observer] = []


def allowed_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor:
    """The boolean attention pattern [B|1, 1|H, q_len, kv_len] (True = may attend).

    transformers hands the attention function a bool mask, an additive float mask, or None when
    sdpa may use is_causal (full causal attention with no padding and q_len == kv_len).
    """
    if attention_mask is None:
        # causal with the queries aligned to the last q_len keys
        qi = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        kj = torch.arange(kv_len, device=device)[None, :]
        return (kj <= qi)[None, None]
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., :kv_len]
    return attention_mask[..., :kv_len] > torch.finfo(attention_mask.dtype).min / 2


def _capturing_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface function: report q/k/v to the active observer, then run sdpa unchanged."""
    if not _ACTIVE:
        raise LowbitError(
            "the lowbit capture attention was called outside `capture_attention(...)`: "
            "restore the model's attention implementation (e.g. model.set_attn_implementation('sdpa'))"
        )
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    replaced = _ACTIVE[-1](module, query, key, value, attention_mask, scale, kwargs.get("softcap"))
    if replaced is not None:
        # an observer that returns [B, T, Hq, Dv] replaces the attention output (fake-quant evaluation)
        return replaced.contiguous(), None
    if kwargs.get("softcap") is not None:
        # sdpa has no softcap; compute the capped softmax eagerly (rare: gemma2-style models)
        return _eager_softcap(query, key, value, attention_mask, scale, kwargs["softcap"])
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _eager_softcap(query, key, value, attention_mask, scale, softcap):
    """Eager attention with tanh logit capping. Returns ([B, T, Hq, Dv], None)."""
    rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(rep, dim=1)
    v = value.repeat_interleave(rep, dim=1)
    s = (query @ k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    allowed = allowed_mask(attention_mask, query.shape[2], key.shape[2], query.device)
    s = s.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(s.float(), dim=-1).to(v.dtype) @ v
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the capturing implementation (idempotent)."""
    AttentionInterface.register(CAPTURE_IMPL, _capturing_attention)
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(CAPTURE_IMPL, sdpa_mask)


def _set_impl(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name


@contextlib.contextmanager
def capture_attention(model, observer: Observer) -> Iterator[None]:
    """Within the block, every attention call of `model` reports its post-RoPE q/k/v to `observer`."""
    if _ACTIVE:
        raise LowbitError("capture_attention is already active: capture one model at a time")
    register()
    previous = getattr(model.config, "_attn_implementation", None) or "sdpa"
    _set_impl(model, CAPTURE_IMPL)
    _ACTIVE.append(observer)
    try:
        yield
    finally:
        _ACTIVE.pop()
        _set_impl(model, previous)


def attention_layers(model) -> list[torch.nn.Module]:
    """The attention modules of `model` in layer order (each carries `layer_idx`)."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if not mods:
        raise LowbitError(f"found no attention modules (with layer_idx and o_proj) in {type(model).__name__}")
    return sorted(mods, key=lambda m: m.layer_idx)
