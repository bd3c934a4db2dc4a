"""RULER-style long-context tasks: prompts, answers and scoring (the model-free half of `--task ruler`).

The four tasks follow RULER as shipped in nvidia-long-context-eval 26.3 (long_context_eval/synthetic.yaml,
data/synthetic/{niah,variable_tracking,common_words_extraction}.py, eval/synthetic/constants.py):

  niah_multikey    (RULER niah_multikey_1) essay haystack, 4 needles "One of the special magic numbers
                   for <key> is: <7 digits>." at random depths, one key asked: the other 3 are distractors
  niah_multivalue  (RULER niah_multivalue) essay haystack, one key with 4 needles (4 values), all asked
  vt               (RULER vt) variable tracking: one chain VAR A = 12345, VAR B = VAR A, ... (4 hops) in
                   repeated noise sentences, with RULER's one-shot example; asked: every variable = value
  cwe              (RULER cwe) a numbered word list, 10 words repeated often (30x at >= 4k, else 6x),
                   the rest rarely (3x / 1x), with RULER's one-shot example; asked: the 10 most common

Prompt = RULER's template + answer_prefix (the base-model form), filled until prompt tokens + the
task's generation budget fit the length, as RULER sizes it. Scoring is RULER's string_match_all: a
trial scores the fraction of its reference strings found (case-insensitively) in the generated text;
a cell reports the mean over trials with its standard error. Keys are adjective-noun pairs (RULER
uses wonderwords' lists; a fixed list here), the cwe words are the distinct words of the haystack
text. Every trial is drawn from random.Random(f"{seed}/{task}/{length}/{trial}"): fixed seed, same
prompts for every row, and the same prompts whichever other tasks or lengths run.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from lowbit.core.errors import LowbitError
from lowbit.eval.needle import split_sentences

TASKS = ("niah_multikey", "niah_multivalue", "vt", "cwe")
# long_context_eval/data/synthetic/constants.py: TASKS[...]["tokens_to_generate"]
NEW_TOKENS = {"niah_multikey": 128, "niah_multivalue": 128, "vt": 30, "cwe": 120}
NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assgined the value {query}, they are: ")  # sic: RULER's spelling
VT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
DEPTHS = [round(x) for x in (100 * i / 39 for i in range(40))]  # niah.py: np.linspace(0, 100, 40) rounded
ADJECTIVES = ("amber", "ancient", "bitter", "brave", "bright", "calm", "clever", "cold", "crimson", "curious",
              "dusty", "eager", "faint", "fierce", "gentle", "golden", "hidden", "hollow", "humble", "icy",
              "jolly", "kind", "lazy", "little", "lively", "lonely", "lucky", "mellow", "misty", "noble",
              "odd", "pale", "proud", "quiet", "rapid", "rusty", "silent", "silver", "sleepy", "swift")
NOUNS = ("anchor", "badger", "barrel", "beacon", "button", "canyon", "castle", "cedar", "cobbler", "comet",
         "crane", "dagger", "falcon", "feather", "fiddle", "garden", "glacier", "hammer", "harbor", "helmet",
         "island", "jacket", "kettle", "lantern", "meadow", "mirror", "orchard", "otter", "parrot", "pebble",
         "pillow", "quarry", "river", "saddle", "spindle", "teapot", "thimble", "tunnel", "violin", "walrus")


@dataclass
class Sample:
    """One trial: the prompt (template + answer prefix), the reference strings, where things are."""

    task: str
    length: int
    trial: int
    prompt: str
    answers: list[str]
    tokens: int = 0
    new_tokens: int = 0
    meta: dict = field(default_factory=dict)


def string_match_all(pred: str, refs: list[str]) -> float:
    """RULER's per-sample string_match_all (0..1): the fraction of refs found in pred, case-insensitive."""
    p = pred.lower()
    return sum(1.0 for r in refs if r.lower() in p) / len(refs)


def mean_se(xs: list[float]) -> tuple[float, float | None]:
    """Mean and its standard error (sample std / sqrt(n)); the SE is None for one trial."""
    n = len(xs)
    if n == 0:
        return float("nan"), None
    m = sum(xs) / n
    if n < 2:
        return m, None
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def word_pool(text: str) -> list[str]:
    """Distinct lower-case alphabetic words of 4..12 letters of `text`, sorted (cwe's vocabulary)."""
    return sorted({w for w in re.findall(r"[a-z]+", text.lower()) if 4 <= len(w) <= 12})


def _key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _singular_niah_template() -> tuple[str, str]:
    """niah.py: one value asked -> 'Some' -> 'A', 'are all' -> 'is', 'are' -> 'is', numbers -> number."""
    t = (NIAH_TEMPLATE + NIAH_PREFIX).replace("Some", "A").replace("are all", "is").replace("are", "is")
    return t, "number"


def _niah(rng: random.Random, sentences_of: Callable[[int], list[str]], n_units: int, *, num_k: int,
          num_v: int) -> tuple[str, list[str], dict]:
    """niah.py generate_input_output (essay haystack): needles shuffled, inserted at sorted random depths."""
    keys, values, needles = [], [], []
    while len(keys) < num_k:  # distinct keys (a duplicate key would make a distractor an answer)
        k = _key(rng)
        if k not in keys:
            keys.append(k)
    used = set()
    for k in keys:
        vs = []
        while len(vs) < num_v:
            v = _number(rng)
            if v not in used:
                used.add(v)
                vs.append(v)
        values.append(vs)
        needles += [NIAH_NEEDLE.format(type_needle_v="numbers", key=k, value=v) for v in vs]
    rng.shuffle(needles)
    sents = sentences_of(n_units)
    cuts = sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
    parts, last = [], 0
    for c, needle in zip(cuts, needles):
        parts.append(" ".join(sents[last:c]))
        parts.append(needle)
        last = c
    parts.append(" ".join(sents[last:]))
    context = " ".join(p for p in parts if p)
    qi = rng.randrange(num_k)
    query, answers = keys[qi], values[qi]
    if num_v == 1:
        t, tv = _singular_niah_template()
    else:
        t, tv = NIAH_TEMPLATE + NIAH_PREFIX, "numbers"
    prompt = t.format(type_needle_v=tv, context=context, query=query)
    distractors = [(k, v) for i, k in enumerate(keys) if i != qi for v in values[i]]
    return prompt, list(answers), {"query": query, "distractors": distractors, "needle_cuts": cuts,
                                   "haystack_sentences": len(sents)}


def _vt_chain(rng: random.Random, num_hops: int, k: int) -> tuple[list[str], list[str]]:
    names: list[str] = []
    while len(names) < num_hops + 1:
        n = "".join(rng.choices(string.ascii_uppercase, k=k))
        if n not in names:
            names.append(n)
    chain = [f"VAR {names[0]} = {rng.randint(10000, 99999)}"]
    chain += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
    return names, chain


def _vt_body(rng: random.Random, n_noise: int, num_hops: int, k: int) -> tuple[str, list[str], str]:
    """variable_tracking.py generate_input_output: the chain at sorted random positions in the noise."""
    names, chain = _vt_chain(rng, num_hops, k)
    sentences = [VT_NOISE] * n_noise
    if len(sentences) <= len(chain):
        sentences = [x + "." if x.strip() else x for s in sentences for x in s.split(".")]
        chain = chain[:max(1, len(sentences) - 1)]
    positions = sorted(rng.sample(range(len(sentences)), len(chain)))
    for j, p in enumerate(positions):
        sentences.insert(p + j, chain[j])
    context = " ".join(sentences).replace(". \n", ".\n")
    value = chain[0].split("=")[-1].strip()
    body = VT_TEMPLATE.format(context=context, query=value) + VT_PREFIX.format(num_v=num_hops + 1, query=value)
    return body, names, value


def _vt(rng: random.Random, n_noise: int, num_hops: int = 4) -> tuple[str, list[str], dict]:
    # RULER's one-shot example: a short chain (3-letter names) in few noises, answered, before the question
    ex_body, ex_names, _ = _vt_body(rng, 5, num_hops, 3)
    body, names, value = _vt_body(rng, n_noise, num_hops, 5)
    prompt = ex_body + " " + " ".join(ex_names) + "\n\n" + body
    return prompt, names, {"value": value, "example_answer": ex_names}


def _cwe_example(rng: random.Random, words: list[str], num_words: int, cw: int, ucw: int,
                 num_cw: int = 10) -> tuple[str, list[str]]:
    picked = rng.sample(words, num_words)
    common, uncommon = picked[:num_cw], picked[num_cw:]
    lst = common * cw + uncommon * ucw
    rng.shuffle(lst)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst)), common


def _cwe(rng: random.Random, words: list[str], num_words: int, length: int) -> tuple[str, list[str], dict]:
    """common_words_extraction.py: below 4096 tokens 6x common / 1x rare (example 20 words, 3x / 1x),
    else 30x / 3x (example 40 words, 10x / 3x)."""
    if len(words) < max(num_words, 40):
        raise LowbitError(f"cwe needs at least {max(num_words, 40)} distinct words; the haystack text has "
                          f"{len(words)}: give a longer --haystack")
    if length < 4096:
        ex_ctx, ex_ans = _cwe_example(rng, words, 20, 3, 1)
        ctx, ans = _cwe_example(rng, words, num_words, 6, 1)
        cw, ucw = 6, 1
    else:
        ex_ctx, ex_ans = _cwe_example(rng, words, 40, 10, 3)
        ctx, ans = _cwe_example(rng, words, num_words, 30, 3)
        cw, ucw = 30, 3
    example = CWE_TEMPLATE.format(context=ex_ctx) + CWE_PREFIX + " " + " ".join(
        f"{i + 1}. {w}" for i, w in enumerate(ex_ans))
    prompt = example + "\n" + CWE_TEMPLATE.format(context=ctx) + CWE_PREFIX
    return prompt, ans, {"common_repeats": cw, "rare_repeats": ucw, "num_words": num_words,
                         "example_answer": ex_ans}


class Generator:
    """Builds the samples of every task at a length, sized for a tokenizer (see the module docstring).

    tokenizer: a HF tokenizer; haystack: the essay text (niah); words: cwe's vocabulary
    (default: word_pool(haystack))."""

    def __init__(self, tokenizer, haystack: str, *, seed: int = 0, words: list[str] | None = None):
        self.tok, self.seed = tokenizer, seed
        self.essay_words = re.sub(r"\s+", " ", haystack).strip().split(" ")
        self._split = split_sentences
        self.words = words if words is not None else word_pool(haystack)
        if not self.essay_words or not self.essay_words[0]:
            raise LowbitError("the haystack text is empty")

    def n_tokens(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=True)["input_ids"])

    def _sentences(self, n_words: int) -> list[str]:
        return self._split(" ".join(self.essay_words[:n_words]))

    def _build(self, task: str, length: int, rng: random.Random, n: int) -> tuple[str, list[str], dict]:
        if task == "niah_multikey":
            return _niah(rng, self._sentences, n, num_k=4, num_v=1)
        if task == "niah_multivalue":
            return _niah(rng, self._sentences, n, num_k=1, num_v=4)
        if task == "vt":
            return _vt(rng, n)
        if task == "cwe":
            return _cwe(rng, self.words, n, length)
        raise LowbitError(f"unknown long-context task {task!r}; the tasks are {', '.join(TASKS)}")

    def _max_units(self, task: str, length: int) -> int:
        """An upper bound of the units a `length`-token prompt can hold (each unit costs >= 1/2 token)."""
        if task.startswith("niah"):
            return min(len(self.essay_words), 2 * length)
        if task == "cwe":
            return min(len(self.words), length)
        return max(1, length // 10)  # a noise line is ~20 tokens

    def sample(self, task: str, length: int, trial: int, new_tokens: int | None = None) -> Sample:
        """The trial's sample: the most haystack units whose prompt + generation budget fit `length`."""
        gen = NEW_TOKENS[task] if new_tokens is None else int(new_tokens)
        budget = length - gen
        key = f"{self.seed}/{task}/{length}/{trial}"
        lo = 10 if task == "cwe" else 1
        hi = max(lo, self._max_units(task, length))

        def build(n):
            p, a, m = self._build(task, length, random.Random(key), n)
            return p, a, m, self.n_tokens(p)

        best = build(lo)
        if best[3] > budget:
            raise LowbitError(f"{task} at length {length}: the template alone takes {best[3]} tokens plus {gen} "
                              f"to generate; use a length of at least {best[3] + gen}")
        while lo < hi:  # largest n whose prompt fits (prompt tokens grow with n)
            mid = (lo + hi + 1) // 2
            cand = build(mid)
            if cand[3] <= budget:
                lo, best = mid, cand
            else:
                hi = mid - 1
        p, a, m, n = best
        m["units"] = lo
        return Sample(task=task, length=length, trial=trial, prompt=p, answers=a, tokens=n, new_tokens=gen, meta=m)
