"""Token sampling and incremental detokenization with stop strings, one request at a time.

Sampling follows the OpenAI parameters: temperature 0 is greedy (argmax); otherwise the logits
are divided by the temperature and, when top_p < 1, cut to the smallest set of tokens whose
probability mass reaches top_p (nucleus). Every request owns a torch.Generator seeded from its
`seed`, so the same request with the same seed draws the same tokens whatever else the server
is doing at the time.
"""

from __future__ import annotations

import torch


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request; seed None draws a fresh seed."""
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        # torch seeds must fit in 64 bits unsigned; map any int there deterministically
        g.manual_seed(int(seed) % (1 << 64))
    return g


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Next token id from logits [V] (any float dtype)."""
    logits = logits.float()
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)  # [V]
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep token i when the mass before it is still below top_p (the first is always kept)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep = before < top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        pick = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(order[pick])
    return int(torch.multinomial(probs, 1, generator=generator))


class Detokenizer:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    The whole output is decoded again at each step (outputs are short; decoding is exact at
    token boundaries that split a UTF-8 character or merge with the next token). Text that
    could still be the start of a stop string, or that ends in an incomplete character, is
    held back until it is certain. On a stop string the text is cut before it.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned
        self.text = ""
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Add one token; return the text that became certain (possibly ''). Sets .stopped on a stop string."""
        self.ids.append(int(token_id))
        text = self._decode()
        if self.stop:
            # a stop string can only start in text not yet emitted (or straddle its start)
            start = max(0, self.emitted - self.holdback)
            cut = min((i for i in (text.find(s, start) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                self.text = text[:cut]
                return self._take(len(self.text))
        self.text = text
        safe = len(text)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            safe = len(text.rstrip("\ufffd"))
        safe = max(self.emitted, safe - self.holdback) if self.stop else safe
        return self._take(safe)

    def flush(self) -> str:
        """The rest of the text (at the end of generation)."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out
