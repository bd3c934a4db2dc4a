"""Model families: one file each in this folder, found by scanning it; everything lowbit knows about a family.

    from lowbit.models import families
    families.for_model_type("qwen2")       # the Family: its step kind, its ArchSpec, its configs
    families.family_geometry("deepseek-v3")  # ModelGeometry of a stored real config (no weights)

A Family (one module here calls `register(Family(...))` at import) holds, for the HF model_type values it
covers:
    step      how the runtime step (lowbit.runtime.step) builds position embeddings: "shared" (one rotary
              for every layer) or "per-type" (per layer type); None: no runtime step for it yet
    arch      ArchSpec: where the decoder's pieces sit (weight quantization, the residual rotation), or None
    configs   real configs of models no small checkpoint exists for here (geometry only), stored as JSON in
              models/configs/families/, each with what a tiny random test model changes (`tiny`) and its
              layer count (`tiny_layers`)
The attention geometry itself is read from the config by lowbit.models.geometry (generic); the cache
hooks a family's attention needs (MLA's latent forward, Gemma-4's K = V scales) are keyed on that
geometry in lowbit.runtime.families. Adding a family is one new file here.

Stored configs:
DeepSeek-V3 (MLA), Kimi-K2 (the same MLA module, 64 heads: its cache is served expanded as
K 192 / V 128) and a Gemma-4 text decoder (sliding 8 KV heads x 256, full 1 KV head x 512 with
attention_k_eq_v, partial RoPE 0.25) and Qwen2.5-VL-7B (a VLM: a Qwen2 decoder, 28 q / 4 KV heads x 128,
M-RoPE sections [16, 24, 24], behind a 32-block vision tower). Each is stored as JSON in
`models/configs/families/` in the hub's key names, which transformers 5.17 and 5.24 both read (5.24 turns Gemma-4's global_head_dim /
num_global_key_value_heads into `per_layer_config`).

Where they come from: deepseek-v3 and kimi-k2 are written from the published config.json values
(the DeepSeek-V3 numbers are also transformers' DeepseekV3Config defaults). gemma4-text has the
attention geometry issue 19 states (8 x 256 sliding, 1 x 512 full, K = V, window 1024, 5:1
pattern, proportional RoPE 0.25 on full layers); its other sizes (hidden 2304, 30 layers, ffn
9216) are transformers' Gemma4TextConfig defaults, not a downloaded checkpoint's. qwen2.5-vl-7b is
the published Qwen/Qwen2.5-VL-7B-Instruct config.json (flat text keys, vision_config nested,
rope_scaling mrope [16, 24, 24], special ids 151643..151656), written from its values; the same
numbers are transformers' Qwen2_5_VLConfig / Qwen2_5_VLVisionConfig defaults and the module shapes
printed by the released checkpoint (q 3584x3584, k/v 512x3584, merger 5120 -> 3584).
Quality on these families is unmeasured: there are random weights only.

`tiny_overrides(name)` keeps the attention geometry (head dims, KV heads, latent rank, RoPE
dims, K = V, sliding pattern) and shrinks everything else (hidden size, experts, ffn) so a
2-layer random model runs on CPU in a test.
"""

from __future__ import annotations

import copy
import importlib
import json
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path

from lowbit.core.errors import LowbitError
from lowbit.models.geometry import ModelGeometry

FAMILY_DIR = Path(__file__).resolve().parents[1] / "configs" / "families"


@dataclass(frozen=True)
class ArchSpec:
    """Module paths relative to the causal-LM model (layers) or to one decoder layer (the rest)."""

    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    attn_readers: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    attn_writer: str = "self_attn.o_proj"
    v_proj: str = "self_attn.v_proj"
    mlp_readers: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    mlp_writer: str = "mlp.down_proj"
    rotation_refusal: str | None = None  # why the residual rotation cannot be folded, if it cannot
    # VLMs: the vision tower (kept unquantized by design: only the decoder is quantized) and the tower's
    # linears whose outputs enter the decoder's residual stream (image embeddings replace image tokens'
    # rows of the embedding output, so the residual rotation must rotate them as it rotates E)
    vision: str | None = None
    vision_writers: tuple[str, ...] = ()


@dataclass(frozen=True)
class StoredConfig:
    """A real config stored in models/configs/families/<name>.json, and its tiny test model's changes."""

    name: str
    tiny: dict = field(default_factory=dict)
    tiny_layers: int = 2


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    step: str | None = None
    arch: ArchSpec | None = None
    configs: tuple[StoredConfig, ...] = ()
    module: str = ""


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family (called at import of its module); a model_type claimed twice is a bug."""
    for other in _REGISTRY.values():
        if other.name != family.name and set(other.model_types) & set(family.model_types):
            raise LowbitError(f"model families {other.name!r} and {family.name!r} both claim "
                              f"{sorted(set(other.model_types) & set(family.model_types))}")
    _REGISTRY[family.name] = family
    return family


def all_families() -> dict[str, Family]:
    """{name: Family} of every module of this package (imported on first use)."""
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    return dict(_REGISTRY)


def for_model_type(model_type: str | None) -> Family | None:
    """The family covering HF `model_type`, or None."""
    return next((f for f in all_families().values() if model_type in f.model_types), None)


def by_model_type(attr: str) -> dict:
    """{model_type: getattr(family, attr)} over every family where that attribute is set (step, arch)."""
    return {mt: getattr(f, attr) for f in all_families().values() for mt in f.model_types
            if getattr(f, attr) is not None}


def _stored() -> dict[str, StoredConfig]:
    return {c.name: c for f in all_families().values() for c in f.configs}


def stored_config_names() -> tuple[str, ...]:
    return tuple(_stored())


def __getattr__(name: str):
    # FAMILIES / TINY_LAYERS: read from the registry when asked (the family modules import this one)
    if name == "FAMILIES":
        return stored_config_names()
    if name == "TINY_LAYERS":
        return {n: c.tiny_layers for n, c in _stored().items()}
    raise AttributeError(name)


def _config(name: str) -> StoredConfig:
    found = _stored()
    if name not in found:
        raise LowbitError(f"unknown model family {name!r}; known: {', '.join(found)}")
    return found[name]


def family_config_dict(name: str) -> dict:
    """The stored real config of family `name` (a new dict each call)."""
    _config(name)
    return json.loads((FAMILY_DIR / f"{name}.json").read_text())


def tiny_overrides(name: str) -> dict:
    """Config fields a tiny random model of family `name` changes (never the attention geometry)."""
    return copy.deepcopy(_config(name).tiny)


def family_geometry(name: str, *, mla: str = "latent"):
    """ModelGeometry of the full-size family config (no weights)."""
    return ModelGeometry.from_config(family_config_dict(name), name=name, mla=mla)
