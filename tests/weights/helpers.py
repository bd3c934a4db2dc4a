"""Small random models for the weight-quantization tests (fast on 2 CPU cores)."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def small_model(model_type: str = "llama", *, layers: int = 2, hidden: int = 96, inter: int = 160, heads: int = 3,
                kv_heads: int = 1, head_dim: int = 32, vocab: int = 99, seed: int = 0, tie: bool = True,
                norm_noise: float = 0.3):
    """A random decoder of `model_type` (llama / mistral / qwen2) with odd-ish sizes and random norm
    weights (so folding the norms matters). hidden 96 = 12 * 8 needs a non-power-of-two Hadamard."""
    cfg = AutoConfig.for_model(
        model_type, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        tie_word_embeddings=tie, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.copy_(1 + norm_noise * torch.randn_like(p))
                elif p.dim() == 2:
                    p.normal_(0, 0.08)
    return model.eval()


def token_ids(vocab: int = 99, batch: int = 2, seq: int = 13, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
