"""Generation (greedy by default): through lowbit's quantized KV cache, or the model's own cache (the demo).

    lm = lowbit.models.resolve("smollm2-135m")
    new_ids, cache = generate(lm, parse_kv_scheme("int4"), "The capital of France is", 12)
    print(lm.tokenizer.decode(new_ids), cache.summary())
    text = greedy_continuation(lm, "The capital of France is", 20)   # DynamicCache, text only

`lowbit generate` and `lowbit demo` parse their flags and call these.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from lowbit.errors import LowbitError

PROMPT = "The capital of France is"  # the demo's prompt: one short, checkable continuation


def read_prompt(prompt: str | None = None, prompt_file: str | Path | None = None) -> str:
    """The prompt text: `prompt`, else the UTF-8 contents of `prompt_file`. Refuses a missing file or blank text."""
    if prompt is not None:
        text = prompt
    elif prompt_file is not None:
        p = Path(prompt_file)
        if not p.is_file():
            raise LowbitError(f"prompt file {p} not found")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            # a traceback here told the user nothing they could act on; name the byte and the fix
            raise LowbitError(f"prompt file {p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                              f"{e.start}); convert it, e.g. `iconv -f latin1 -t utf-8 {p}`") from None
    else:
        raise LowbitError("no prompt: pass --prompt TEXT or --prompt-file PATH")
    if not text.strip():
        raise LowbitError("the prompt is empty; pass some text")
    return text


def _pad_id(tokenizer) -> int | None:
    # generate() warns (and guesses) without a pad id; eos is the usual stand-in for causal LMs
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def context_length(model) -> int | None:
    """The model's context in tokens (config max_position_embeddings, or its text config's), else None."""
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        n = getattr(cfg, "max_position_embeddings", None) if cfg is not None else None
        if isinstance(n, int) and n > 0:
            return n
    return None


def check_context(n_prompt: int, max_new_tokens: int, context: int | None, name: str) -> None:
    """Refuse a prompt + continuation longer than the model's context, before any cache is built: a
    30,858-token prompt on smollm2-135m (context 8,192) died allocating 34 GB in attention."""
    if context is None or n_prompt + max_new_tokens <= context:
        return
    if n_prompt >= context:
        raise LowbitError(f"the prompt is {n_prompt} tokens but {name}'s context is {context} tokens; shorten it to "
                          f"at most {context - max_new_tokens} tokens (with --max-new-tokens {max_new_tokens})")
    raise LowbitError(f"the prompt is {n_prompt} tokens and --max-new-tokens {max_new_tokens} makes "
                      f"{n_prompt + max_new_tokens}, beyond {name}'s context of {context} tokens; lower "
                      f"--max-new-tokens to {context - n_prompt} or shorten the prompt")


def check_sampling(temperature: float, top_p: float) -> bool:
    """True when these ask for sampling (temperature > 0); greedy is temperature 0. Refuses what would be
    silently ignored (a top-p under greedy) or is out of range."""
    if not math.isfinite(temperature) or temperature < 0:
        raise LowbitError(f"--temperature must be 0 (greedy) or more, got {temperature}")
    if not (0 < top_p <= 1):
        raise LowbitError(f"--top-p must be in (0, 1], got {top_p}")
    if temperature == 0 and top_p != 1:
        raise LowbitError(f"--top-p {top_p} needs sampling: add --temperature T (T > 0; greedy is the default)")
    return temperature > 0


class _Clock:
    """A transformers streamer that only timestamps: generate() puts the prompt first, then each new
    token as it is chosen, so the second put marks the first token (time to first token)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate(lm, scheme, prompt: str, max_new_tokens: int, *, decode_backend: str = "auto",
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, timing: dict | None = None):
    """Generate through a fresh QuantizedKVCache: greedy by default, sampled when temperature > 0.
    Returns (new token ids [N], cache).

    lm: a lowbit.models.LoadedModel (model, tokenizer, geometry); scheme: a KVScheme valid for it.
    seed: the sampling seed (torch.manual_seed); None with sampling draws one and reports it in `timing`.
    timing: a dict to fill with prompt_tokens, new_tokens, ttft_s (prompt in -> first token out),
        decode_tokens_per_s (the tokens after the first), total_s, seed (when sampling).
    """
    from lowbit.kv import QuantizedKVCache
    from lowbit.kv.cache import cache_kwargs

    if lm.tokenizer is None:
        raise LowbitError(f"model {lm.name} has no tokenizer; generate needs one")
    sample = check_sampling(temperature, top_p)
    model = lm.model
    enc = lm.tokenizer(prompt, return_tensors="pt")
    n_prompt = int(enc["input_ids"].shape[1])
    check_context(n_prompt, max_new_tokens, context_length(model), lm.name)  # before the cache and any forward
    cache = QuantizedKVCache(model, scheme, geometry=lm.geometry, decode_backend=decode_backend)
    dev = next(model.parameters()).device
    enc = enc.to(dev)
    kw = {"do_sample": False}
    if sample:
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        torch.manual_seed(seed)
        kw = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": None}
    clock = _Clock()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, pad_token_id=_pad_id(lm.tokenizer), streamer=clock,
            **kw, **cache_kwargs(model, cache),
        )
    t1 = time.perf_counter()
    new = out[0, n_prompt:]
    if timing is not None:
        first = clock.times[1] if len(clock.times) > 1 else t1
        n_after = len(new) - 1
        timing.update(prompt_tokens=n_prompt, new_tokens=len(new), ttft_s=first - t0, total_s=t1 - t0,
                      decode_tokens_per_s=(n_after / (t1 - first)) if n_after > 0 and t1 > first else None,
                      seed=seed if sample else None)
    return new, cache


def greedy_continuation(lm, prompt: str, max_new_tokens: int) -> str:
    """Greedy-decode `max_new_tokens` after `prompt` with the model's own cache; returns only the new text."""
    if lm.tokenizer is None:
        raise LowbitError(f"{lm.name} has no tokenizer files: add them to the model directory")
    enc = lm.tokenizer(prompt, return_tensors="pt").to(lm.model.device)
    with torch.no_grad():
        out = lm.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=_pad_id(lm.tokenizer))
    return lm.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
