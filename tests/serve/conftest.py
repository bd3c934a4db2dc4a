"""Fixtures for the server tests: a tiny random smollm2-geometry model with a byte-level tokenizer.

The tokenizer has the three smollm2 special tokens at ids 0-2 (so the model config's bos/eos/pad
ids stay valid) and the 256 byte-level symbols after them: every text encodes, multi-byte
characters take several tokens (which exercises the detokenizer), and decoding is exact.
"""

from __future__ import annotations

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 259


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) == VOCAB
    return fast


def tiny_runtime(kv: str = "bf16", *, max_context: int = 256, eos: tuple[int, ...] = (2,), seed: int = 0, **kv_flags):
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.models.geometry import ModelGeometry
    from lowbit.models.tiny import tiny_model
    from lowbit.serve.loader import Runtime

    model, config = tiny_model("smollm2-135m", vocab_size=VOCAB, seed=seed)
    with torch.no_grad():
        # x4 on the matrices: the 0.02-std init makes every prompt repeat one token; scaled, different
        # prompts give different continuations, so mixed-up requests would show
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    return Runtime(model=model, tokenizer=byte_tokenizer(), geometry=ModelGeometry.from_config(config, name="tiny"),
                   name="tiny", scheme=parse_kv_scheme(kv, **kv_flags), weights=None, max_context=max_context,
                   eos_token_ids=list(eos))


@torch.no_grad()
def reference_greedy(rt, ids: list[int], max_tokens: int, chunk: int = 10**9) -> tuple[list[int], str]:
    """Greedy tokens straight from the model with a fresh cache of rt.scheme (prompt fed in `chunk`s)."""
    from lowbit.serve.kvcache import CacheFactory

    cache = CacheFactory(rt.model, rt.scheme, rt.geometry).new()
    out: list[int] = []
    logits = None
    for i in range(0, len(ids), chunk):
        logits = rt.model(input_ids=torch.tensor([ids[i:i + chunk]]), cache=cache, use_cache=True).logits[0, -1]
    for _ in range(max_tokens):
        t = int(torch.argmax(logits))
        if t in rt.eos_token_ids:
            break
        out.append(t)
        logits = rt.model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1]
    return out, rt.tokenizer.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def bf16_server():
    """A started engine + TestClient over a bf16 tiny runtime (prefill in chunks of 7)."""
    from fastapi.testclient import TestClient

    from lowbit.serve.server import build

    rt = tiny_runtime("bf16")
    engine, app = build(rt, max_active=4, prefill_chunk=7)
    engine.start()
    with TestClient(app) as client:
        yield rt, engine, client
    engine.stop()
