"""Which transformers Auto class builds a model lowbit runs as a causal LM.

Text decoders are AutoModelForCausalLM. A VLM (Qwen2.5-VL: Qwen2_5_VLForConditionalGeneration) is
not in that mapping on transformers 5.24 (it is AutoModelForImageTextToText's), yet its generate
takes text alone or text with images and returns next-token logits like any causal LM, and the
KV cache sees only its decoder. Every loader (resolve, load_quantized, tiny_model) asks here so a
VLM directory opens the same way everywhere, on 5.17 and 5.24.
"""

from __future__ import annotations


def causal_lm_class(config):
    """AutoModelForCausalLM when it knows `config`'s type, else AutoModelForImageTextToText when that
    does (VLMs), else AutoModelForCausalLM (whose own error then names the unknown type)."""
    from transformers import AutoModelForCausalLM

    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    try:
        from transformers import AutoModelForImageTextToText
    except ImportError:  # pragma: no cover - older transformers
        return AutoModelForCausalLM
    if type(config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM

