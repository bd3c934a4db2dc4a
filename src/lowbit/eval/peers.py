"""What `lowbit eval` runs, one Entry per table row: the bf16 reference, lowbit schemes, and peers.

Every entry makes a fresh cache per window and measures what that cache holds after the window
(`Accounting`): bits per element of its quantized tier, bits per element over all its tiers, and the
quantized K/V rows. A row is one token's key (or value) vector of one KV head of one layer, so a
token quantized in K and V on every layer counts 2 * layers * kv_heads rows.

  bf16             transformers DynamicCache (built with the model config, so sliding layers keep
                   their window); the reference every KL / top-1 / ΔPPL is measured against
  lowbit schemes   QuantizedKVCache with a KVScheme (lowbit.kv, lowbit.kv.scheme)
  kivi2, kivi4     lowbit recipes: K per channel, V per token, group 32, recent 128, no sink
  hf-quanto-int2/4 transformers QuantizedCache, backend quanto (optimum-quanto)
  hf-hqq-int2/4    transformers QuantizedCache, backend hqq
  vllm-*           vLLM 0.26's --kv-cache-dtype choices, fake-quant with vLLM's arithmetic
                   (lowbit.eval.peers_vllm)
HF QuantizedCache runs with residual_length = our recent window and transformers' other defaults
(axis 0, i.e. groups of q_group_size consecutive elements along head_dim), q_group_size =
min(64, head_dim). It supports full-attention layers only: on a model with sliding-window layers
its entry is `cannot run: ...`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

# torch is imported inside the functions that use it: `lowbit eval`'s parser reads PEERS, and a
# mistyped flag must not wait for torch
# vLLM's KV dtypes as fake-quant rows (lowbit.eval.peers_vllm builds them; named here so the parser needs no torch)
VLLM_PEERS = ("vllm-fp8", "vllm-fp8-calibrated", "vllm-int8-pth", "vllm-int4-pth", "vllm-tq-k8v4",
              "vllm-tq-4bit-nc", "vllm-tq-k3v4-nc", "vllm-tq-3bit-nc")

PEERS = ("hf-quanto-int2", "hf-quanto-int4", "hf-hqq-int2", "hf-hqq-int4", "kivi2", "kivi4") + VLLM_PEERS
REFERENCE = "bf16"


@dataclass
class Accounting:
    """What one cache held at the end of one window (sums, so windows add up).

    quant_bits / quant_elts: bits and K/V elements of the quantized tier (codes + scales + zeros)
    all_bits / all_elts:     bits and K/V elements over every tier (dense tiers at their dtype)
    quantized_rows:          K rows + V rows held quantized (see module docstring)
    """

    quant_bits: float = 0.0
    quant_elts: int = 0
    all_bits: float = 0.0
    all_elts: int = 0
    quantized_rows: int = 0

    def __iadd__(self, o: Accounting) -> Self:
        self.quant_bits += o.quant_bits
        self.quant_elts += o.quant_elts
        self.all_bits += o.all_bits
        self.all_elts += o.all_elts
        self.quantized_rows += o.quantized_rows
        return self

    @property
    def bits_per_elt(self) -> float | None:
        """Bits per element of the quantized tier; None when nothing was quantized."""
        return self.quant_bits / self.quant_elts if self.quant_elts else None

    @property
    def avg_bits_per_elt(self) -> float | None:
        """Bits per element over all tiers; None when the cache held nothing."""
        return self.all_bits / self.all_elts if self.all_elts else None


@dataclass
class Entry:
    """One row of the evaluation.

    name:       the row label (scheme or peer name)
    kind:       "reference" | "lowbit" | "lowbit-peer" | "hf-quantized" | "vllm-peer"
    make_cache: model -> a fresh transformers Cache (one per window)
    account:    cache -> Accounting after a window
    quantizes:  True when the entry must quantize rows (zero quantized rows is a dead hook: abort)
    config:     what the entry is, for the JSON (recipe fields, backend options)
    cannot_run: the reason this entry cannot run on this model, or None
    attention:  the transformers attention implementation this entry's forwards use ("lowbit" for
                QuantizedKVCache, which reads its tiers there); None = the model's own (SDPA)
    """

    name: str
    kind: str
    make_cache: Callable[[Any], Any] | None
    account: Callable[[Any], Accounting] | None
    quantizes: bool
    config: dict = field(default_factory=dict)
    cannot_run: str | None = None
    attention: str | None = None


def tensor_bits(t: Any) -> float:
    """Bits actually held by a tensor, a quanto tensor subclass (its inner tensors, e.g. packed codes
    + scale + shift), or a tuple/list/dict of those. Non-tensors count 0."""
    import torch

    if t is None:
        return 0.0
    if isinstance(t, (tuple, list)):
        return sum(tensor_bits(x) for x in t)
    if isinstance(t, dict):
        return sum(tensor_bits(x) for x in t.values())
    if isinstance(t, torch.Tensor):
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            return sum(tensor_bits(getattr(t, n)) for n in names)
        return 8.0 * t.numel() * t.element_size()
    return 0.0


def _dense_elts(x) -> int:
    import torch

    return int(x.numel()) if isinstance(x, torch.Tensor) and x.dim() == 4 else 0


def dynamic_cache_accounting(cache) -> Accounting:
    """DynamicCache: every tier dense, nothing quantized."""
    acc = Accounting()
    for layer in cache.layers:
        for x in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            n = _dense_elts(x)
            acc.all_elts += n
            acc.all_bits += 8.0 * n * x.element_size() if n else 0.0
    return acc


def hf_quantized_accounting(cache) -> Accounting:
    """transformers QuantizedCache: the quantized part covers the first cumulative_length - residual
    tokens of each layer; its bits are those of the backend's stored tensors (codes, scale, zero)."""
    import torch

    acc = Accounting()
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor):
            continue
        resid_k, resid_v = _dense_elts(layer.keys), _dense_elts(layer.values)
        resid_tokens = layer.keys.shape[-2] if resid_k else 0
        q_tokens = int(layer.cumulative_length) - resid_tokens
        qk, qv = layer._quantized_keys, layer._quantized_values
        if qk is not None and q_tokens > 0:
            b, h, d_k = _geometry_of(layer, keys)
            d_v = layer.values.shape[-1] if resid_v else d_k
            q_elts = b * h * q_tokens * (d_k + d_v)
            q_bits = tensor_bits(qk) + tensor_bits(qv)
            acc.quant_bits += q_bits
            acc.quant_elts += q_elts
            acc.all_bits += q_bits
            acc.all_elts += q_elts
            acc.quantized_rows += 2 * b * h * q_tokens
        for x in (layer.keys, layer.values):
            n = _dense_elts(x)
            if n:
                acc.all_elts += n
                acc.all_bits += 8.0 * n * x.element_size()
    return acc


def _geometry_of(layer, keys) -> tuple[int, int, int]:
    """(batch, kv heads, head_dim) of a QuantizedLayer, from its residual tensor or, when the residual
    was just flushed (empty 1-D tensor), from the shape its backend recorded."""
    import torch

    if keys.dim() == 4:
        return int(keys.shape[0]), int(keys.shape[1]), int(keys.shape[-1])
    qk = layer._quantized_keys
    shape = None
    if isinstance(qk, tuple) and isinstance(qk[1], dict):  # hqq: (codes, meta)
        shape = qk[1].get("shape")
    elif isinstance(qk, torch.Tensor):  # quanto: a tensor subclass with the logical shape
        shape = qk.shape
    if shape is None or len(shape) != 4:
        raise RuntimeError(f"cannot read the quantized K shape of {type(layer).__name__}")
    return int(shape[0]), int(shape[1]), int(shape[-1])


def reference_entry() -> Entry:
    from transformers import DynamicCache

    return Entry(
        name=REFERENCE,
        kind="reference",
        make_cache=lambda model: DynamicCache(config=model.config),
        account=dynamic_cache_accounting,
        quantizes=False,
        config={"cache": "transformers.DynamicCache", "bits": 16},
    )


def _has_sliding_layers(geometry) -> int:
    return sum(1 for layer in geometry.layers if layer.attention != "full")


def hf_quantized_entry(name: str, geometry, recent: int) -> Entry:
    """transformers QuantizedCache peer `hf-<backend>-int<bits>`, or a cannot-run entry."""
    _, backend, bits_s = name.split("-")
    bits = int(bits_s.removeprefix("int"))
    head_dim = min(min(lg.head_dim_k, lg.head_dim_v) for lg in geometry.layers)
    opts = {"backend": backend, "nbits": bits, "residual_length": int(recent), "q_group_size": min(64, head_dim),
            "axis_key": 0, "axis_value": 0}
    entry = Entry(name=name, kind="hf-quantized", make_cache=None, account=hf_quantized_accounting,
                  quantizes=True, config={"cache": "transformers.QuantizedCache", **opts})
    module = {"quanto": "optimum.quanto", "hqq": "hqq"}[backend]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pkg = {"quanto": "optimum-quanto", "hqq": "hqq"}[backend]
        entry.cannot_run = f"the {backend} backend needs the package {pkg}, which is not installed"
        return entry
    n_sliding = _has_sliding_layers(geometry)
    if n_sliding:
        entry.cannot_run = (f"transformers QuantizedCache supports full-attention layers only; this model has "
                            f"{n_sliding} sliding-window layers")
        return entry

    def make(model):
        from transformers import QuantizedCache

        return QuantizedCache(backend, model.config, nbits=bits, axis_key=0, axis_value=0,
                              q_group_size=opts["q_group_size"], residual_length=int(recent))

    entry.make_cache = make
    return entry


def lowbit_cache_accounting(cache) -> Accounting:
    """QuantizedKVCache: bits from its own memory report (live tensors: codes + fp16 scale/zero for the
    middle, model dtype for sink and recent); rows = K+V rows ever encoded into a middle tier (rows
    evicted later by a sliding window still count: they went through the quantizer)."""
    mem = cache.memory()
    acc = Accounting(quantized_rows=int(cache.quantized_rows_total()))
    for lm, g in zip(mem.layers, cache.geometry.layers):
        per_token = mem.batch * g.num_kv_heads * (g.head_dim_k + g.head_dim_v)
        acc.all_elts += per_token * sum(lm.tokens.values())
        acc.all_bits += 8.0 * (lm.bytes["sink"] + lm.bytes["middle_k"] + lm.bytes["middle_v"] + lm.bytes["recent"])
        if cache.scheme.quantized and lm.tokens["middle"]:
            acc.quant_elts += lm.elements_k + lm.elements_v
            acc.quant_bits += 8.0 * (lm.bytes["middle_k"] + lm.bytes["middle_v"])
    return acc


def lowbit_entry(label: str, scheme, geometry, *, kind: str = "lowbit") -> Entry:
    """A lowbit KVScheme as a row: QuantizedKVCache, "lowbit" attention. The scheme is validated against
    the geometry now (a LowbitError here is bad input, raised before any forward): resolved once per
    device, every window's cache is built from that plan."""
    from lowbit.kv.plan import resolve

    plans = {"cpu": resolve(scheme, geometry, device="cpu")}

    def make(model):
        from lowbit.runtime.cache import QuantizedKVCache, model_device

        dev = model_device(model)
        if dev not in plans:
            plans[dev] = resolve(scheme, geometry, device=dev)
        return QuantizedKVCache.from_plan(model, plans[dev])

    return Entry(name=label, kind=kind, make_cache=make, account=lowbit_cache_accounting,
                 quantizes=bool(scheme.quantized), attention="lowbit",
                 config={"cache": "lowbit.kv.QuantizedKVCache", "describe": scheme.describe(), **scheme.to_dict()})
