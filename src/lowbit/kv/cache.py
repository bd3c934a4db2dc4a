"""QuantizedKVCache: a transformers Cache holding K/V as sink + packed middle + recent ring.

    from lowbit.kv import QuantizedKVCache
    cache = QuantizedKVCache(model, "int4")              # or a KVScheme; validates, installs "lowbit" attention
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=20)   # 5.24 also: cache=cache
    print(cache.summary())

One cache serves one sequence batch (like DynamicCache): build a new one per generate call.
It works in a plain forward loop too (feed chunks with `past_key_values=cache` / `cache=cache`
and the 2-D attention_mask of everything so far, or None without padding).

Decode backend: on CUDA, a one-token query may go to the fused split-K kernel
(`lowbit.kernels.decode_attention.decode_attention`, which reads the same middle layout, see
TierView); "auto" uses it when it can take the case, else the torch path, recording why in
`backend_notes`. `backend_calls` counts what ran, so results can name their backend.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from transformers.cache_utils import Cache

from lowbit.errors import LowbitError
from lowbit.kv import attention as attn
from lowbit.kv.layer import QuantizedKVLayer
from lowbit.kv.rotations import layer_rotations, rotate, unrotate
from lowbit.recipe import KVScheme, parse_kv_scheme

log = logging.getLogger(__name__)
DECODE_BACKENDS = ("auto", "torch", "triton")


def cache_kwargs(model, cache) -> dict:
    """{name: cache} for model.generate / forward: transformers 5.24 renamed `past_key_values` to
    `cache` (the old name still works there, with a warning); 5.17 knows only `past_key_values`."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def _split_model(model_or_config):
    if isinstance(model_or_config, torch.nn.Module):
        cfg = getattr(model_or_config, "config", None)
        if cfg is None:
            raise LowbitError(f"{type(model_or_config).__name__} has no config; pass a transformers model")
        return model_or_config, cfg
    return None, model_or_config


class QuantizedKVCache(Cache):
    """Tiered quantized KV cache (see lowbit.kv.layer for the tiers).

    model_or_config: the transformers model (its attention is switched to "lowbit", which is
        exact with any other cache too) or its config (then call lowbit.kv.install_attention).
    scheme: KVScheme or a scheme string ("int4", "k4v2", ...). Validated against the model's
        geometry here, so bad input fails before any token is cached.
    geometry: a lowbit.models.ModelGeometry (default: from the config); its name is what a
        RotationSet is checked against.
    levels: Lloyd-Max levels per layer {layer: {"k": [2**bits], "v": [2**bits]}} (default Gaussian).
    chunk_tokens: middle rows dequantized per streamed block on the torch path.
    decode_backend: "auto" | "torch" | "triton".
    """

    def __init__(
        self,
        model_or_config,
        scheme: KVScheme | str = "bf16",
        *,
        geometry=None,
        levels: dict | None = None,
        chunk_tokens: int = 1024,
        decode_backend: str = "auto",
    ):
        model, config = _split_model(model_or_config)
        if isinstance(scheme, str):
            scheme = parse_kv_scheme(scheme)
        if not isinstance(scheme, KVScheme):
            raise LowbitError(f"scheme must be a KVScheme or a scheme string, got {type(scheme).__name__}")
        if decode_backend not in DECODE_BACKENDS:
            raise LowbitError(f"decode backend {decode_backend!r} unknown; use one of {DECODE_BACKENDS}")
        if geometry is None:
            from lowbit.models.geometry import ModelGeometry

            geometry = ModelGeometry.from_config(config)
        scheme.validate(geometry)
        if scheme.fold_v_rotation and model is not None and getattr(model, "_lowbit_v_folded", None) != scheme.rotation:
            raise LowbitError(
                "the scheme folds V's rotation into the weights but this model was not folded: call "
                "lowbit.kv.rotations.fold_v_into_weights(model, scheme, geometry) first"
            )
        rots = layer_rotations(scheme, geometry)
        levels = levels or {}
        layers = [
            QuantizedKVLayer(g, scheme.for_layer(g.index), rk, rv, chunk_tokens=chunk_tokens, levels=levels.get(g.index))
            for g, (rk, rv) in zip(geometry.layers, rots)
        ]
        super().__init__(layers=layers)
        self.scheme = scheme
        self.geometry = geometry
        self.decode_backend = decode_backend
        self.backend_calls: Counter = Counter()
        self.backend_notes: list[str] = []
        self._pending: int | None = None
        if model is not None:
            attn.install_attention(model)

    # ---------------------------------------------------------------- write
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._pending is not None:
            stale, self._pending = self._pending, None
            raise LowbitError(
                f"layer {stale} stored K/V in the lowbit cache but its attention did not read them: the model is "
                "not using the 'lowbit' attention; build the cache with the model (QuantizedKVCache(model, ...)) "
                "or call lowbit.kv.install_attention(model)"
            )
        if layer_idx >= len(self.layers):
            raise LowbitError(f"layer {layer_idx} is beyond the {len(self.layers)} layers this cache was built for")
        out = self.layers[layer_idx].update(key_states, value_states)
        attn.post_handoff(self, layer_idx, *out)
        self._pending = layer_idx
        return out

    # ---------------------------------------------------------------- read
    def attend(self, layer_idx: int, query: torch.Tensor, attention_mask, *, scaling: float, softcap=None):
        """Attention of query [B, Hq, Lq, D] (the chunk just stored) over layer `layer_idx`'s tiers.

        Returns [B, Lq, Hq, Dv] in the query dtype (what transformers' attention functions return)."""
        self._pending = None
        layer: QuantizedKVLayer = self.layers[layer_idx]
        B, Hq, Lq, D = query.shape
        Hkv = layer.geometry.num_kv_heads
        if Hq % Hkv:
            raise LowbitError(f"layer {layer_idx}: {Hq} query heads are not a multiple of {Hkv} KV heads")
        G = Hq // Hkv
        keep = attn.padding_keep(attention_mask, layer.n, query.device)
        # q [B,Hq,Lq,D] -> [B,Hkv,G*Lq,D]: query head j = h*G + g reads KV head h
        qg = rotate(query.reshape(B, Hkv, G * Lq, D), layer.rot_k).reshape(B, Hkv, G, Lq, D)
        out = self._fused_decode(layer, qg, keep, scaling, softcap) if Lq == 1 else None
        if out is None:
            q_slots = torch.arange(layer.n - Lq, layer.n, device=query.device)
            min_slot = layer.n - Lq - (layer.window - 1) if layer.window else 0
            out = attn.online_attention(
                qg, layer.blocks(min_slot), q_slots, scaling=scaling, window=layer.window, keep=keep, softcap=softcap
            )
            self.backend_calls["torch"] += 1
        layer.chunk = None  # the chunk's own exact K/V are needed only by this attention
        Dv = out.shape[-1]
        out = unrotate(out.reshape(B, Hkv, G * Lq, Dv), layer.rot_v)  # back from V's rotated basis
        return out.reshape(B, Hq, Lq, Dv).transpose(1, 2).to(query.dtype).contiguous()

    def _note(self, msg: str) -> None:
        if msg not in self.backend_notes:
            self.backend_notes.append(msg)
            log.info("lowbit KV decode: %s", msg)

    def _kernel_reason(self, layer, view, keep, softcap) -> str | None:
        """Why the fused kernel cannot take this decode step of `layer` (None: it can)."""
        kc, vc = layer.k_codec, layer.v_codec
        if not (kc.quantized and vc.quantized):
            return "16-bit middle tier (the kernel reads packed codes)"
        for which, c in (("K", kc), ("V", vc)):
            if c.tq.axis != "token":
                return f"{which} grouped per channel (the kernel takes per-token groups)"
            if c.tq.lloyd_max:
                return f"{which} uses Lloyd-Max levels (the kernel takes the affine grid)"
            if c.cbits not in (2, 4, 8) or c.head_dim not in (64, 128, 256) or c.head_dim // c.group not in (1, 2):
                return f"{which} {c.bits}-bit, head_dim {c.head_dim}, group {c.group} (kernel: 2/4/8 bits, D 64/128/256, group D or D/2)"
        if softcap:
            return "attention logit soft-capping"
        if view.ring_k.shape[-2] == 0:
            return "the new token was flushed straight into the middle (recent 0)"
        if keep is not None:
            return "padding mask (the kernel takes prefix-valid tiers)"
        return None

    def _fused_decode(self, layer, qg, keep, scaling, softcap):
        """Hook for the fused decode kernel (lowbit.kernels.decode_attention, same middle layout).

        qg [B, Hkv, G, 1, D] rotated. Returns [B, Hkv, G, 1, Dv] float32, or None for the torch path.
        "auto" uses the kernel on CUDA when it can take the case; "triton" insists (CPU runs it in
        the Triton interpreter); reasons for falling back are kept in backend_notes.
        """
        if self.decode_backend == "torch" or (self.decode_backend == "auto" and not qg.is_cuda):
            return None
        strict = self.decode_backend == "triton"
        try:
            from lowbit.kernels.decode_attention import decode_attention
        except ImportError as e:
            if strict:
                raise LowbitError(f"decode backend 'triton' unavailable: {e}") from None
            self._note(f"fused decode kernel unavailable ({e}); torch path")
            return None
        view = layer.view()
        reason = self._kernel_reason(layer, view, keep, softcap)
        if reason:
            if strict:
                raise LowbitError(f"decode backend 'triton' cannot take layer {layer.layer_idx}: {reason}")
            self._note(f"layer {layer.layer_idx}: {reason}; torch path")
            return None
        B, Hkv, G, _, D = qg.shape
        q = qg.reshape(B, Hkv * G, D).to(layer.dtype).contiguous()
        # The kernel has no window mask: hand it only the slots the query sees (>= n - window).
        # Every tier is a contiguous slot range, so that is a slice of each (row views, no copy).
        lo = view.n - layer.window if layer.window is not None else 0
        ring_lo = view.n - view.ring_k.shape[-2]
        s0, m0, r0 = max(0, lo), max(0, lo - view.mid_lo), max(0, lo - ring_lo)
        dense = {}
        if view.sink_k.shape[-2] > s0:
            dense.update(sink_k=view.sink_k[:, :, s0:], sink_v=view.sink_v[:, :, s0:])
        if view.ring_k.shape[-2] > r0:
            dense.update(recent_k=view.ring_k[:, :, r0:], recent_v=view.ring_v[:, :, r0:])
        mid = (None,) * 6
        if view.mid_len > m0:
            mk, mv = view.mid_k, view.mid_v
            mid = tuple(f[name][:, :, m0:] for f in (mk, mv) for name in ("codes", "scale", "zero"))
        out = decode_attention(
            q, *mid, k_bits=layer.k_codec.cbits, v_bits=layer.v_codec.cbits, sm_scale=scaling, **dense
        )  # [B, Hq, Dv]
        self.backend_calls["triton"] += 1
        return out.float().reshape(B, Hkv, G, 1, -1)

    # ---------------------------------------------------------------- HF API
    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, max_length: int):
        raise LowbitError("the lowbit KV cache cannot be cropped; start a new cache instead")

    def reset(self):
        super().reset()
        self._pending = None
        self.backend_calls.clear()

    # ---------------------------------------------------------------- accounting
    def quantized_rows_total(self) -> int:
        """Token x KV-head rows ever encoded into a quantized middle (K + V, all layers, evicted ones too)."""
        return sum(layer.quantized_rows_total for layer in self.layers)

    def memory(self):
        """Memory held now, measured from the live tensors (see lowbit.kv.memory.MemoryReport)."""
        from lowbit.kv.memory import measure

        return measure(self)

    def summary(self) -> str:
        """One line: tokens, quantized tokens and rows, middle bits/element, bytes per tier, backend."""
        return self.memory().summary(self)
