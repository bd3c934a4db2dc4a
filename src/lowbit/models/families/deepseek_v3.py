"""DeepSeek-V3 and Kimi-K2 (the same MLA module; Kimi-K2 has 64 heads): geometry only, no checkpoint here.

The stored configs are written from the published config.json values (the DeepSeek-V3 numbers are also
transformers' DeepseekV3Config defaults). The cache serves MLA as the latent (mla-latent) or expanded
(K 192 / V 128); the hooks are lowbit.runtime.families'.
"""

from lowbit.models.families import Family, StoredConfig, register

TINY = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 96,
        "intermediate_size": 192, "moe_intermediate_size": 64, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}

FAMILY = register(Family("deepseek-v3", ("deepseek_v3",), configs=(
    StoredConfig("deepseek-v3", TINY, 2),
    StoredConfig("kimi-k2", {**TINY, "bos_token_id": 0, "eos_token_id": 1}, 2),  # its ids sit past a tiny vocab
), module=__name__))
