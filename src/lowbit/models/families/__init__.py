"""Real configs of model families no small checkpoint exists for here (geometry only, no weights).

DeepSeek-V3 (MLA), Kimi-K2 (the same MLA module, 64 heads: its cache is served expanded as
K 192 / V 128) and a Gemma-4 text decoder (sliding 8 KV heads x 256, full 1 KV head x 512 with
attention_k_eq_v, partial RoPE 0.25) and Qwen2.5-VL-7B (a VLM: a Qwen2 decoder, 28 q / 4 KV heads x 128,
M-RoPE sections [16, 24, 24], behind a 32-block vision tower). Each is stored as JSON in `configs/families/` in the hub's
key names, which transformers 5.17 and 5.24 both read (5.24 turns Gemma-4's global_head_dim /
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

import json
from pathlib import Path

from lowbit.core.errors import LowbitError
from lowbit.models.geometry import ModelGeometry

FAMILY_DIR = Path(__file__).parent / "configs" / "families"
FAMILIES = ("deepseek-v3", "kimi-k2", "gemma4-text", "qwen2.5-vl-7b")

# What a tiny test model changes; attention geometry stays the real one.
_TINY = {
    "deepseek-v3": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 96,
                    "intermediate_size": 192, "moe_intermediate_size": 64, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
    "gemma4-text": {"hidden_size": 256, "intermediate_size": 256, "final_logit_softcapping": None},
}
# Qwen2.5-VL: head_dim 128 (hidden / heads) and the real 4 KV heads kept, with 8 q heads (GQA 2:1, not the real
# 7:1, which at 4 KV heads means hidden 3584: too big for a CPU test) -> hidden 1024;
# M-RoPE sections and the vision patch geometry (patch 14, 2x2 merge, temporal 2) kept; the tower is 2 blocks
# of width 64 with the last one full attention (the real tower: windowed blocks + every 8th full). The
# special ids sit past a tiny vocabulary, so they move to the top of a 99-token one in the real order.
_TINY["qwen2.5-vl-7b"] = {
    "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 256,
    "vocab_size": 99, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "vision_start_token_id": 93,
    "vision_end_token_id": 94, "vision_token_id": 95, "image_token_id": 96, "video_token_id": 97,
    "vision_config": {"depth": 2, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96, "num_heads": 2,
                      "in_chans": 3, "out_hidden_size": 1024, "patch_size": 14, "spatial_merge_size": 2,
                      "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [1],
                      "tokens_per_second": 2, "temporal_patch_size": 2},
}
_TINY["kimi-k2"] = {**_TINY["deepseek-v3"], "bos_token_id": 0, "eos_token_id": 1}  # its ids sit past a tiny vocab
TINY_LAYERS = {"deepseek-v3": 2, "kimi-k2": 2, "gemma4-text": 6, "qwen2.5-vl-7b": 2}


def family_config_dict(name: str) -> dict:
    """The stored real config of family `name` (a new dict each call)."""
    if name not in FAMILIES:
        raise LowbitError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return json.loads((FAMILY_DIR / f"{name}.json").read_text())


def tiny_overrides(name: str) -> dict:
    """Config fields a tiny random model of family `name` changes (never the attention geometry)."""
    if name not in FAMILIES:
        raise LowbitError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    import copy

    return copy.deepcopy(_TINY.get(name, {}))


def family_geometry(name: str, *, mla: str = "latent"):
    """ModelGeometry of the full-size family config (no weights)."""
    return ModelGeometry.from_config(family_config_dict(name), name=name, mla=mla)
