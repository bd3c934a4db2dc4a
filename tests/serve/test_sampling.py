"""Sampling (greedy, temperature, nucleus, seeds) and the detokenizer (stop strings, split characters)."""

from __future__ import annotations

import torch

from lowbit.serve.sampling import Detokenizer, make_generator, sample
from tests.serve.conftest import byte_tokenizer


def test_greedy_and_seeded_sampling():
    logits = torch.randn(99, generator=torch.Generator().manual_seed(1))
    assert sample(logits, 0.0, 1.0, make_generator(0)) == int(torch.argmax(logits))
    a = [sample(logits, 1.0, 1.0, g) for g in [make_generator(7)] for _ in range(20)]
    b = [sample(logits, 1.0, 1.0, g) for g in [make_generator(7)] for _ in range(20)]
    assert a == b and len(set(a)) > 3


def test_top_p_never_draws_outside_the_nucleus():
    # probabilities .5, .3, .15, .05 -> top_p .75 keeps the first two (mass before the 3rd is .8)
    p = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = p.log()
    g = make_generator(3)
    draws = {sample(logits, 1.0, 0.75, g) for _ in range(300)}
    assert draws == {1, 3}
    assert {sample(logits, 1.0, 0.5, g) for _ in range(50)} == {1}  # mass .5 reached by the first alone
    assert {sample(logits, 1.0, 1.0, g) for _ in range(600)} == {0, 1, 2, 3}


def _feed(tok, text: str, stop: list[str]) -> tuple[list[str], Detokenizer]:
    d = Detokenizer(tok, stop)
    deltas = []
    for t in tok.encode(text):
        deltas.append(d.add(t))
        if d.stopped:
            break
    deltas.append(d.flush())
    return deltas, d


def test_detokenizer_holds_split_characters_and_cuts_stops():
    tok = byte_tokenizer()
    text = "naïve café — 3 €, ok END trailing"
    deltas, d = _feed(tok, text, [])
    assert "".join(deltas) == text
    assert not any("\ufffd" in x for x in deltas)  # multi-byte characters arrive whole
    deltas, d = _feed(tok, text, ["END", "zzz"])
    assert "".join(deltas) == "naïve café — 3 €, ok " and d.stopped
    assert not any("EN" in x for x in deltas)  # the held-back start of the stop never leaks
    deltas, d = _feed(tok, text, ["€"])  # a stop that is itself a multi-byte character
    assert "".join(deltas) == "naïve café — 3 " and d.stopped


def _metaspace_tokenizer():
    # a sentencepiece-like tokenizer: words carry a leading "▁" that decoding turns into a space and drops at
    # the very start, the case an incremental decode gets wrong if it decodes the new token on its own
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "the", "s", ".", ",", "▁é", "é", "<unk>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>"), len(words) - 1


def test_incremental_detokenizer_equals_a_whole_decode_on_random_ids():
    g = torch.Generator().manual_seed(5)
    byte_tok = byte_tokenizer()
    meta_tok, meta_n = _metaspace_tokenizer()
    utf8 = byte_tok.encode("naïve café — 3 €, 日本語 ok")
    for tok, pool in ((byte_tok, list(range(3, byte_tok.vocab_size))), (meta_tok, list(range(meta_n))), (byte_tok, utf8)):
        for _ in range(60):
            n = int(torch.randint(1, 40, (1,), generator=g))
            ids = [pool[int(i)] for i in torch.randint(0, len(pool), (n,), generator=g)]
            d = Detokenizer(tok, [])
            out = "".join(d.add(t) for t in ids) + d.flush()
            assert out == tok.decode(ids, skip_special_tokens=True), ids
