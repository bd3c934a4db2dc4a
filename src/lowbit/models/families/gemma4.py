"""A Gemma-4 text decoder: sliding 8 KV heads x 256, full 1 KV head x 512 with attention_k_eq_v, partial RoPE 0.25.

The stored config has the attention geometry issue 19 states (window 1024, 5:1 pattern, proportional
RoPE 0.25 on full layers); its other sizes (hidden 2304, 30 layers, ffn 9216) are transformers'
Gemma4TextConfig defaults, not a downloaded checkpoint's. K = V layers need the cache's K-scale hook
(lowbit.runtime.families).
"""

from lowbit.models.families import Family, StoredConfig, register

FAMILY = register(Family("gemma4", ("gemma4_text",), configs=(
    StoredConfig("gemma4-text", {"hidden_size": 256, "intermediate_size": 256, "final_logit_softcapping": None}, 6),
), module=__name__))
