"""The cache on the real built-in models (fp32 on CPU): exactness, INT8, and the generation checks.

Slow: loads smollm2-135m and gemma3-270m and runs ~700-token prompts.
"""

from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from lowbit.calib.corpora import WIKITEXT2_PATH
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models import BUILTINS, load
from lowbit.runtime.cache import QuantizedKVCache
from lowbit.runtime.generate import generate

from .helpers import rel_err, run_chunks

pytestmark = pytest.mark.slow
NAMES = [n for n in ("smollm2-135m", "gemma3-270m") if BUILTINS[n].is_installed()]


@pytest.fixture(scope="module", params=NAMES)
def lm(request):
    return load(request.param)


def wiki_paragraphs() -> list[str]:
    if not WIKITEXT2_PATH.is_file():
        pytest.skip(f"WikiText-2 not at {WIKITEXT2_PATH}")
    lines = WIKITEXT2_PATH.read_text(encoding="utf-8").split("\n")
    return [p.strip() for p in lines if p.strip() and not p.strip().startswith("=")]


def paris_prompt(tokenizer, n_tokens: int = 590) -> str:
    """~600 tokens of WikiText that never name Paris or France, then 'The capital of France is'."""
    paras = [p for p in wiki_paragraphs() if not any(w in p for w in ("Paris", "France", "French"))]
    out = []
    for p in paras[8:]:
        out.append(p)
        if len(tokenizer("\n".join(out))["input_ids"]) >= n_tokens:
            break
    return "\n".join(out) + "\n\nThe capital of France is"


def _tiers(name, **kw):
    return replace(parse_kv_scheme(name, **kw), sink=4, recent=8, page=4)


def test_bf16_matches_dynamic_cache(lm):
    model, tok = lm.model, lm.tokenizer
    texts = wiki_paragraphs()[3:6]
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok([t[:400] for t in texts], return_tensors="pt", padding=True, padding_side="left")
    ids, mask = enc["input_ids"][:, :60], enc["attention_mask"][:, :60]
    assert (mask == 0).any()  # really left-padded
    cases = [
        ("prefill-then-decode", ids[:1], None, [40] + [1] * 20),
        ("chunked", ids[:1], None, [13, 1, 20, 7, 1, 18]),
        ("left-padded batch of 3", ids, mask, [31] + [1] * 9 + [20]),
    ]
    for what, x, m, chunks in cases:
        model.set_attn_implementation("sdpa")
        ref = run_chunks(model, DynamicCache(config=model.config), x, m, chunks)
        cache = QuantizedKVCache(model, _tiers("bf16"), geometry=lm.geometry)
        out = run_chunks(model, cache, x, m, chunks)
        err = rel_err(out, ref, m)
        print(f"{lm.name} bf16 {what}: max rel err {err:.2e}")
        assert err < 1e-4, what


def test_int8_within_one_percent(lm):
    model = lm.model
    ids = lm.tokenizer("\n".join(wiki_paragraphs()[10:14]), return_tensors="pt")["input_ids"][:, :160]
    chunks = [100] + [1] * 60
    model.set_attn_implementation("sdpa")
    ref = run_chunks(model, DynamicCache(config=model.config), ids, None, chunks)
    cache = QuantizedKVCache(model, replace(parse_kv_scheme("int8"), sink=16, recent=32), geometry=lm.geometry)
    out = run_chunks(model, cache, ids, None, chunks)
    err = float((out - ref).norm() / ref.norm())
    print(f"{lm.name} int8: relative logit error {err:.4f}, {cache.summary()}")
    assert cache.quantized_rows_total() > 0 and err < 0.01


def test_gemma3_int8_same_12_greedy_tokens_as_bf16():
    if "gemma3-270m" not in NAMES:
        pytest.skip("gemma3-270m not installed")
    lm = load("gemma3-270m")
    prompt = paris_prompt(lm.tokenizer)
    a, _ = generate(lm, parse_kv_scheme("bf16"), prompt, 12)
    b, cache = generate(lm, parse_kv_scheme("int8"), prompt, 12)
    print("gemma3 bf16:", repr(lm.tokenizer.decode(a)), "| int8:", repr(lm.tokenizer.decode(b)), "|", cache.summary())
    assert torch.equal(a, b) and len(a) == 12
    assert cache.memory().quantized_tokens() >= 300


@pytest.mark.parametrize(
    "scheme",
    [parse_kv_scheme("int4"), parse_kv_scheme("int2"), parse_kv_scheme("int2", rotation="hadamard", lloyd_max=True)],
    ids=["int4", "int2", "int2-hadamard-lloydmax"],
)
def test_smollm2_answers_paris(scheme):
    if "smollm2-135m" not in NAMES:
        pytest.skip("smollm2-135m not installed")
    lm = load("smollm2-135m")
    new, cache = generate(lm, scheme, paris_prompt(lm.tokenizer), 12)
    text = lm.tokenizer.decode(new, skip_special_tokens=True)
    mem = cache.memory()
    print(f"smollm2 {scheme.name}: {text!r} | {cache.summary()}")
    assert "Paris" in text
    assert mem.quantized_tokens() >= 300  # default tiers: most of the ~600-token prompt is in the middle
    bk, bv = mem.middle_bits_per_element()
    assert max(bk, bv) <= scheme.k.bits + 0.5
