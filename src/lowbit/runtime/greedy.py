"""Greedy generation: through lowbit's quantized KV cache, or the model's own cache (the demo).

    lm = lowbit.runtime.load.resolve("smollm2-135m")
    new_ids, cache = generate(lm, parse_kv_scheme("int4"), "The capital of France is", 12)
    print(lm.tokenizer.decode(new_ids), cache.summary())
    text = greedy_continuation(lm, "The capital of France is", 20)   # DynamicCache, text only

`lowbit generate` and `lowbit demo` parse their flags and call these.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lowbit.core.errors import LowbitError

PROMPT = "The capital of France is"  # the demo's prompt: one short, checkable continuation


def read_prompt(prompt: str | None = None, prompt_file: str | Path | None = None) -> str:
    """The prompt text: `prompt`, else the UTF-8 contents of `prompt_file`. Refuses a missing file or blank text."""
    if prompt is not None:
        text = prompt
    elif prompt_file is not None:
        p = Path(prompt_file)
        if not p.is_file():
            raise LowbitError(f"prompt file {p} not found")
        text = p.read_text(encoding="utf-8")
    else:
        raise LowbitError("no prompt: pass --prompt TEXT or --prompt-file PATH")
    if not text.strip():
        raise LowbitError("the prompt is empty; pass some text")
    return text


def _pad_id(tokenizer) -> int | None:
    # generate() warns (and guesses) without a pad id; eos is the usual stand-in for causal LMs
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def generate(lm, scheme, prompt: str, max_new_tokens: int, *, decode_backend: str = "auto"):
    """Greedy-generate through a fresh QuantizedKVCache. Returns (new token ids [N], cache).

    lm: a lowbit.models.LoadedModel (model, tokenizer, geometry); scheme: a KVScheme valid for it.
    """
    from lowbit.runtime.cache import QuantizedKVCache, cache_kwargs

    if lm.tokenizer is None:
        raise LowbitError(f"model {lm.name} has no tokenizer; generate needs one")
    model = lm.model
    cache = QuantizedKVCache(model, scheme, geometry=lm.geometry, decode_backend=decode_backend)
    dev = next(model.parameters()).device
    enc = lm.tokenizer(prompt, return_tensors="pt").to(dev)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=_pad_id(lm.tokenizer),
            **cache_kwargs(model, cache),
        )
    return out[0, enc["input_ids"].shape[1]:], cache


def greedy_continuation(lm, prompt: str, max_new_tokens: int) -> str:
    """Greedy-decode `max_new_tokens` after `prompt` with the model's own cache; returns only the new text."""
    if lm.tokenizer is None:
        raise LowbitError(f"{lm.name} has no tokenizer files: add them to the model directory")
    enc = lm.tokenizer(prompt, return_tensors="pt").to(lm.model.device)
    with torch.no_grad():
        out = lm.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=_pad_id(lm.tokenizer))
    return lm.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
