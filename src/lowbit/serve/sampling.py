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

    Decoding is incremental over a short window (the last tokens that made text, plus the new ones):
    the new text is decode(window + new)[len(decode(window)):], so a token that only completes a
    UTF-8 character or merges with its neighbour is handled as a whole-output decode would, and a
    step costs O(window) instead of O(output) (a 500-token stream re-decoded whole cost ~0.3 ms a
    token on the host). Text that could still be the start of a stop string, or that ends in an
    incomplete character, is held back until it is certain. On a stop string the text is cut before it.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned
        self.text = ""
        self.stopped = False
        self._done = ""  # the text of ids[:_read]
        self._win = 0  # ids[_win:_read] made the last text (the window's left context); ids[_read:] are pending
        self._read = 0

    def _decode(self, a: int, b: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[a:b], skip_special_tokens=True)

    def _advance(self, final: bool = False) -> str:
        """The text of every id so far: the settled text plus what the pending ids add (an incomplete
        character stays pending, shown as U+FFFD, unless final)."""
        prev = self._decode(self._win, self._read)
        cur = self._decode(self._win)
        new = cur[len(prev):]
        if new and (final or not cur.endswith("\ufffd")):
            self._done += new
            self._win, self._read = self._read, len(self.ids)
            return self._done
        return self._done + new

    def add(self, token_id: int) -> str:
        """Add one token; return the text that became certain (possibly ''). Sets .stopped on a stop string."""
        self.ids.append(int(token_id))
        text = self._advance()
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
        if not self.stopped:
            self.text = self._advance(final=True)
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out
