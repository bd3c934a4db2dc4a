"""Qwen2.5-VL: a Qwen2 decoder under model.language_model behind a vision tower (transformers >= 4.52 layout).

The tower sits at model.visual; its PatchMerger's last linear (mlp.2) writes the image embeddings. The stored
config is the published Qwen/Qwen2.5-VL-7B-Instruct one. Its tiny test model keeps head_dim 128 (hidden /
heads) and the real 4 KV heads, with 8 q heads (GQA 2:1, not the real 7:1, which at 4 KV heads means hidden
3584: too big for a CPU test) -> hidden 1024; M-RoPE sections and the vision patch geometry (patch 14, 2x2
merge, temporal 2) kept; the tower is 2 blocks of width 64 with the last one full attention (the real tower:
windowed blocks + every 8th full). The special ids sit past a tiny vocabulary, so they move to the top of a
99-token one in the real order.
"""

from lowbit.models.families import ArchSpec, Family, StoredConfig, register

ARCH = ArchSpec(
    layers="model.language_model.layers", embed="model.language_model.embed_tokens",
    final_norm="model.language_model.norm", vision="model.visual", vision_writers=("model.visual.merger.mlp.2",),
)

TINY = {
    "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 256,
    "vocab_size": 99, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "vision_start_token_id": 93,
    "vision_end_token_id": 94, "vision_token_id": 95, "image_token_id": 96, "video_token_id": 97,
    "vision_config": {"depth": 2, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96, "num_heads": 2,
                      "in_chans": 3, "out_hidden_size": 1024, "patch_size": 14, "spatial_merge_size": 2,
                      "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [1],
                      "tokens_per_second": 2, "temporal_patch_size": 2},
}

FAMILY = register(Family("qwen2.5-vl", ("qwen2_5_vl",), arch=ARCH,
                         configs=(StoredConfig("qwen2.5-vl-7b", TINY, 2),), module=__name__))
