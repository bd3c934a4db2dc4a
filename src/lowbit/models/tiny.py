"""Tiny random-weight models with a built-in's real geometry, for fast tests (no GGUF needed).

`tiny_model("gemma3-270m")` is Gemma3ForCausalLM with the real config (4 q / 1 kv heads,
head_dim 256, window 512, hidden 640, ...) cut to 6 layers: 5 sliding + 1 full, the real 5:1
pattern. `tiny_model("smollm2-135m")` is a 2-layer Llama with 9 q / 3 kv heads, head_dim 64.
Pass `vocab_size` (e.g. 99) to shrink the embedding: gemma's real 262144 x 640 table alone is
168M parameters.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from lowbit.core.errors import LowbitError
from lowbit.models import families
from lowbit.models.auto import causal_lm_class
from lowbit.models.registry import get_builtin

# Default depth per built-in: the smallest that shows every attention kind of the real model.
DEFAULT_LAYERS = {"smollm2-135m": 2, "gemma3-270m": 6, "qwen2.5-coder-0.5b": 2, "qwen2.5-coder-1.5b": 2}


def tiny_config(name: str, num_layers: int | None = None, vocab_size: int | None = None) -> PretrainedConfig:
    """The built-in's real config with `num_layers` layers (layer_types cut/repeated to match)
    and optionally a smaller vocabulary (special token ids must stay below it). A family of
    lowbit.models.families (deepseek-v3, kimi-k2, gemma4-text) keeps its attention geometry and
    takes that module's small sizes for the rest."""
    if name in families.FAMILIES:  # geometry-only families: real attention geometry, small everything else
        d = {**families.family_config_dict(name), **families.tiny_overrides(name)}
        default_layers = families.TINY_LAYERS[name]
    else:
        d = get_builtin(name).config_dict()
        default_layers = DEFAULT_LAYERS[name]
    n = default_layers if num_layers is None else int(num_layers)
    if n < 1:
        raise LowbitError(f"tiny_model: num_layers must be >= 1, got {n}")
    d["num_hidden_layers"] = n
    if d.get("layer_types"):
        # the real pattern is periodic (gemma: 5 sliding, 1 full), so repeating it keeps it real
        real = d["layer_types"]
        d["layer_types"] = [real[i % len(real)] for i in range(n)]
    if vocab_size is not None:
        special = [d.get(k) for k in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id",
                                      "image_token_id", "video_token_id", "vision_start_token_id",
                                      "vision_end_token_id", "vision_token_id")]
        top = max((t for t in special if isinstance(t, int)), default=0)
        if vocab_size <= top:
            raise LowbitError(f"tiny_model: vocab_size must exceed the special token ids (max {top}), got {vocab_size}")
        d["vocab_size"] = int(vocab_size)
    model_type = d.pop("model_type")
    return AutoConfig.for_model(model_type, **d)


def tiny_model(
    name: str,
    num_layers: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
) -> tuple[PreTrainedModel, PretrainedConfig]:
    """Random-weight model (eval mode, SDPA attention) with the built-in's real geometry.

    Deterministic per `seed`; the caller's global RNG state is left untouched.
    Returns (model, config); `ModelGeometry.from_config(config)` gives its geometry.
    """
    config = tiny_config(name, num_layers, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = causal_lm_class(config).from_config(config, attn_implementation="sdpa")
    model = model.to(dtype).eval()
    return model, model.config


def tiny_tokenizer_free_inputs(
    config: PretrainedConfig, batch_size: int = 1, seq_len: int = 17, seed: int = 0
) -> torch.Tensor:
    """Random token ids [batch_size, seq_len] (int64) in [0, vocab_size), deterministic per seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=g)


TINY_WORDS = ("the", "cat", "sat", "on", "mat", "a", "dog", "ran", "and", "to", ".", ",")


def tiny_tokenizer():
    """A word-level fast tokenizer (whitespace/punctuation split) for tests that need text:
    ids 0-3 are <unk>, <pad>, <bos>, <eos>, then TINY_WORDS in order (16 ids in all), so it
    fits any tiny model with vocab_size >= 16. Saves/loads like any HF tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ("<unk>", "<pad>", "<bos>", "<eos>", *TINY_WORDS)
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<bos>", eos_token="<eos>")
