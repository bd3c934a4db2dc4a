"""Real configs of model families no small checkpoint exists for here (geometry only, no weights).

DeepSeek-V3 (MLA), Kimi-K2 (the same MLA module, 64 heads: its cache is served expanded as
K 192 / V 128) and a Gemma-4 text decoder (sliding 8 KV heads x 256, full 1 KV head x 512 with
attention_k_eq_v, partial RoPE 0.25). Each is stored as JSON in `configs/families/` in the hub's
key names, which transformers 5.17 and 5.24 both read (5.24 turns Gemma-4's global_head_dim /
num_global_key_value_heads into `per_layer_config`).

Where they come from: deepseek-v3 and kimi-k2 are written from the published config.json values
(the DeepSeek-V3 numbers are also transformers' DeepseekV3Config defaults). gemma4-text has the
attention geometry issue 19 states (8 x 256 sliding, 1 x 512 full, K = V, window 1024, 5:1
pattern, proportional RoPE 0.25 on full layers); its other sizes (hidden 2304, 30 layers, ffn
9216) are transformers' Gemma4TextConfig defaults, not a downloaded checkpoint's.
Quality on these families is unmeasured: there are random weights only.

`tiny_overrides(name)` keeps the attention geometry (head dims, KV heads, latent rank, RoPE
dims, K = V, sliding pattern) and shrinks everything else (hidden size, experts, ffn) so a
2-layer random model runs on CPU in a test.
"""

from __future__ import annotations

import json
from pathlib import Path

from lowbit.errors import LowbitError

FAMILY_DIR = Path(__file__).parent / "configs" / "families"
FAMILIES = ("deepseek-v3", "kimi-k2", "gemma4-text")

# What a tiny test model changes; attention geometry stays the real one.
_TINY = {
    "deepseek-v3": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 96,
                    "intermediate_size": 192, "moe_intermediate_size": 64, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
    "gemma4-text": {"hidden_size": 256, "intermediate_size": 256, "final_logit_softcapping": None},
}
_TINY["kimi-k2"] = {**_TINY["deepseek-v3"], "bos_token_id": 0, "eos_token_id": 1}  # its ids sit past a tiny vocab
TINY_LAYERS = {"deepseek-v3": 2, "kimi-k2": 2, "gemma4-text": 6}


def family_config_dict(name: str) -> dict:
    """The stored real config of family `name` (a new dict each call)."""
    if name not in FAMILIES:
        raise LowbitError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return json.loads((FAMILY_DIR / f"{name}.json").read_text())


def tiny_overrides(name: str) -> dict:
    """Config fields a tiny random model of family `name` changes (never the attention geometry)."""
    if name not in FAMILIES:
        raise LowbitError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return dict(_TINY.get(name, {}))


def family_geometry(name: str, *, mla: str = "latent"):
    """ModelGeometry of the full-size family config (no weights)."""
    from lowbit.models.geometry import ModelGeometry

    return ModelGeometry.from_config(family_config_dict(name), name=name, mla=mla)
