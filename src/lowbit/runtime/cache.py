"""QuantizedKVCache: a transformers Cache holding K/V as sink + packed middle + recent ring.

    from lowbit.runtime.cache import QuantizedKVCache
    cache = QuantizedKVCache(model, "int4")              # or a KVScheme; validates, installs "lowbit" attention
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=20)   # 5.24 also: cache=cache
    print(cache.summary())

One cache serves one sequence batch (like DynamicCache): build a new one per generate call.
It works in a plain forward loop too (feed chunks with `past_key_values=cache` / `cache=cache`
and the 2-D attention_mask of everything so far, or None without padding).

Decode backend: the plan (lowbit.kv.plan) chose per layer, once: on CUDA a one-token query goes
to the fused split-K kernel (lowbit.backends.triton_decode) where it takes the layer, else the
torch path; the reasons are in `plan.table()` and `backend_notes`. `backend_calls` counts what
ran, so results can name their backend.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from transformers.cache_utils import Cache

from lowbit.backends import torch_stream as attn
from lowbit.backends import triton_decode as decode_backend
from lowbit.core.errors import LowbitError
from lowbit.kv.capabilities import call_reason
from lowbit.kv.key_affine import map_queries
from lowbit.kv.layer import QuantizedKVLayer
from lowbit.kv.memory import measure
from lowbit.kv.plan import resolve as plan_resolve
from lowbit.kv.rotations import rotate, rotation_key, unrotate
from lowbit.kv.scheme import KVScheme
from lowbit.models.geometry import ModelGeometry
from lowbit.runtime import families

log = logging.getLogger(__name__)

def model_device(model) -> str:
    """'cuda' or 'cpu': where the model's parameters live (a config alone plans for CPU)."""
    if model is None:
        return "cpu"
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


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


def _check_key_affine(config) -> None:
    """A key affine's shift is exact only when every logit of a query moves by the same amount: refuse
    logit soft-capping (tanh is not shift-invariant)."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None and getattr(cfg, "attn_logit_softcapping", None):
            raise LowbitError("the model soft-caps its attention logits, so a key affine's shift would change "
                              "the softmax; use a rotation without a key affine for this model")


class QuantizedKVCache(Cache):
    """Tiered quantized KV cache (see lowbit.kv.layer for the tiers), built from a resolved Plan.

    model_or_config: the transformers model (its attention is switched to "lowbit", which is
        exact with any other cache too) or its config (then call lowbit.kv.install_attention).
    scheme: KVScheme or a scheme string ("int4", "k4v2", ...), resolved here into a plan
        (lowbit.kv.plan.resolve: checked against the geometry, rotation / levels files opened once)
        so bad input fails before any token is cached. A server resolves once and calls
        `QuantizedKVCache.from_plan(model, plan)` per request instead.
    geometry: a lowbit.models.ModelGeometry (default: from the config); its name is what a
        RotationSet is checked against.
    chunk_tokens: middle rows dequantized per streamed block on the torch path.
    decode_backend: "auto" | "torch" | "triton" (see lowbit.kv.plan.resolve); the device the plan is
        resolved for is the model's (CPU for a config).
    """

    def __init__(
        self,
        model_or_config,
        scheme: KVScheme | str = "bf16",
        *,
        geometry=None,
        chunk_tokens: int = 1024,
        decode_backend: str = "auto",
        plan=None,
    ):
        model, config = _split_model(model_or_config)
        if plan is None:
            if geometry is None:
                geometry = ModelGeometry.from_config(config)
            plan = plan_resolve(scheme, geometry, device=model_device(model), decode_backend=decode_backend)
        scheme = plan.scheme
        if (scheme.fold_v_rotation and model is not None
                and getattr(model, "_lowbit_v_folded", None) != rotation_key(scheme.rotation)):
            raise LowbitError(
                "the scheme folds V's rotation into the weights but this model was not folded: call "
                "lowbit.kv.rotations.fold_v_into_weights(model, scheme, geometry) first"
            )
        if any(lp.k_affine is not None and bool((lp.k_affine.shift != 0).any()) for lp in plan.layers):
            _check_key_affine(config)
        super().__init__(layers=[QuantizedKVLayer(lp, chunk_tokens=chunk_tokens) for lp in plan.layers])
        self.plan = plan
        self.scheme = scheme
        self.geometry = plan.geometry
        self.decode_backend = plan.decode_backend
        self.backend_calls: Counter = Counter()
        self.backend_notes: list[str] = []
        self._pending: int | None = None
        if model is not None:
            attn.install_attention(model)
            families.install(model, self)  # MLA forwards (DeepseekV3), K = V scales (Gemma-4)

    @classmethod
    def from_plan(cls, model_or_config, plan, *, chunk_tokens: int = 1024) -> QuantizedKVCache:
        """A new (empty) cache for one generate call from a resolved lowbit.kv.plan.Plan: no file is
        opened and nothing is re-checked, so building one per request costs only the buffers."""
        return cls(model_or_config, plan=plan, chunk_tokens=chunk_tokens)

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
        qg = query.reshape(B, Hkv, G * Lq, D)
        qg = rotate(map_queries(qg, layer.k_affine), layer.rot_k).reshape(B, Hkv, G, Lq, D)
        out = self._fused_decode(layer, qg, keep, scaling, softcap) if Lq == 1 else None
        if out is None:
            out = attn.stream_layer(layer, qg, keep, scaling, softcap)
            self.backend_calls["torch"] += 1
        layer.chunk = None  # the chunk's own exact K/V are needed only by this attention
        Dv = out.shape[-1]
        out = unrotate(out.reshape(B, Hkv, G * Lq, Dv), layer.rot_v)  # back from V's rotated basis
        return out.reshape(B, Hq, Lq, Dv).transpose(1, 2).to(query.dtype).contiguous()

    def _note(self, msg: str) -> None:
        if msg not in self.backend_notes:
            self.backend_notes.append(msg)
            log.info("lowbit KV decode: %s", msg)

    def _fused_decode(self, layer, qg, keep, scaling, softcap):
        """The decode step on the backend the plan chose for this layer (lowbit.backends.triton_decode).

        qg [B, Hkv, G, 1, D] rotated. Returns [B, Hkv, G, 1, Dv] float32, or None for the torch path.
        The plan decided once per layer; only per-call rules (padding, soft-capping, where the new
        token sits) are checked here, by the backend's own `call_reason`.
        """
        choice = layer.plan.backends["decode"]
        if choice.name != "triton-decode":
            if choice.reason:
                self._note(f"layer {layer.layer_idx}: torch path ({choice.reason})")
            return None
        if qg.device.type != self.plan.device:
            raise LowbitError(f"the cache was planned for {self.plan.device} but the model runs on {qg.device.type}; "
                              "resolve the plan for this device")
        reason = call_reason(layer, keep, softcap)
        if reason:
            if self.decode_backend == "triton":
                raise LowbitError(f"decode backend 'triton' cannot take layer {layer.layer_idx}: {reason}")
            self._note(f"layer {layer.layer_idx}: {reason}; torch path")
            return None
        try:
            out = decode_backend.run(layer, qg, scaling)
        except ImportError as e:
            raise LowbitError(f"the fused decode kernel needs Triton ({e}); pip install 'lowbit[kernels]' "
                              "or use decode_backend 'torch'") from None
        self.backend_calls["triton"] += 1
        return out

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
        return measure(self)

    def summary(self) -> str:
        """One line: tokens, quantized tokens and rows, middle bits/element, bytes per tier, backend."""
        return self.memory().summary(self)
