"""Random-weight models of a named geometry: what `lowbit bench decode` times and `serve --model random:NAME` serves.

    model, cfg = build_model("llama3-8b", "cuda")     # LlamaForCausalLM, seed 0, bf16, eval mode
    tok = word_tokenizer(cfg.vocab_size)             # every id decodes to one word ("t123")

Same geometry name, same weights (seed 0), on every machine: load tests and benchmarks compare like
with like. Not for text: the logits of random weights are flat.
"""

from __future__ import annotations

import torch

from lowbit.core.errors import LowbitError

GEOMETRIES = {
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rope_theta": 500000.0,
                      "max_position_embeddings": 1 << 17},
    # CPU smoke geometry (same head layout, 2 small layers)
    "tiny-llama": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000, "max_position_embeddings": 1 << 15},
}


def build_model(geometry: str, device: str, dtype=torch.bfloat16):
    """(LlamaForCausalLM of GEOMETRIES[geometry] with seed-0 random weights on `device` in eval mode, its config)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if geometry not in GEOMETRIES:
        raise LowbitError(f"unknown geometry {geometry!r}; use one of {', '.join(GEOMETRIES)}")
    cfg = LlamaConfig(**GEOMETRIES[geometry])
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval(), cfg


def word_tokenizer(vocab_size: int):
    """A tokenizer whose every id decodes to one word ("t123"), for random-weight models with no
    tokenizer of their own: each generated token is one streamed delta."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0")
