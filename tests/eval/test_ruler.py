"""RULER-style tasks: the generator (answers where they say, distractors differ, seeds reproduce, prompts
fit), the scorer, and one end-to-end run on a tiny model through the real caches."""

import itertools
import json
import random

import pytest

from lowbit.core.errors import LowbitError
from lowbit.eval import ruler as R
from lowbit.models.tiny import TINY_WORDS, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def hay():
    rng = random.Random(0)
    pool = sorted({"".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(5, 8))) for _ in range(300)})
    pool += list(TINY_WORDS[:10])
    sents = []
    for _ in range(600):
        words = [rng.choice(pool) for _ in range(rng.randint(5, 12))]
        sents.append(" ".join(words).capitalize() + ".")
    return " ".join(sents)


@pytest.fixture(scope="module")
def gen(hay):
    # a real-tokenizer stand-in: whitespace words (the tiny tokenizer maps unknown words to one token)
    class WordTok:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": list(range(len(text.split()) + (1 if add_special_tokens else 0)))}

    return R.Generator(WordTok(), hay, seed=3)


def test_niah_multikey_answer_and_distractors(gen):
    s = gen.sample("niah_multikey", 1024, 0)
    assert len(s.answers) == 1
    q = s.meta["query"]
    needle = f"One of the special magic numbers for {q} is: {s.answers[0]}."
    assert s.prompt.count(needle) == 1
    assert len(s.meta["distractors"]) == 3
    for k, v in s.meta["distractors"]:
        assert k != q and v != s.answers[0]
        assert f"One of the special magic numbers for {k} is: {v}." in s.prompt
    # the question asks for the query key only, and the prompt ends in RULER's answer prefix
    assert s.prompt.endswith(f" The special magic number for {q} mentioned in the provided text is")
    assert s.tokens + s.new_tokens <= 1024 and s.tokens > 0.8 * (1024 - s.new_tokens)


def test_niah_multivalue_all_values_present(gen):
    s = gen.sample("niah_multivalue", 1024, 1)
    assert len(s.answers) == 4 and len(set(s.answers)) == 4
    for v in s.answers:
        assert f"for {s.meta['query']} is: {v}." in s.prompt
    assert "What are all the special magic numbers" in s.prompt


def test_vt_chain_resolves_to_the_answer(gen):
    s = gen.sample("vt", 1024, 0)
    names, value = s.answers, s.meta["value"]
    body = s.prompt.split("\n\n", 1)[1]  # after the one-shot example
    assert f"VAR {names[0]} = {value}" in body
    for a, b in itertools.pairwise(names):
        assert f"VAR {b} = VAR {a}" in body
    # the chain's lines appear in order
    pos = [body.index(f"VAR {n} =") for n in names]
    assert pos == sorted(pos)
    assert s.prompt.endswith("they are: ")


def test_cwe_common_words_are_the_most_common(gen):
    s = gen.sample("cwe", 1024, 0)
    listing = s.prompt.rsplit("Memorize the ones that appear most often.\n", 1)[1].split("\nQuestion:")[0]
    words = [w for w in listing.split() if not w.rstrip(".").isdigit()]
    counts = {w: words.count(w) for w in set(words)}
    top = sorted(counts, key=lambda w: -counts[w])[:10]
    assert set(top) == set(s.answers)
    assert min(counts[w] for w in s.answers) == 6 and max(c for w, c in counts.items() if w not in s.answers) == 1
    s4k = gen.sample("cwe", 4096, 0)
    assert s4k.meta["common_repeats"] == 30 and s4k.meta["rare_repeats"] == 3


def test_seeds_reproduce_and_trials_differ(hay, gen):
    a = gen.sample("niah_multikey", 1024, 2)
    b = gen.sample("niah_multikey", 1024, 2)
    assert a.prompt == b.prompt and a.answers == b.answers
    c = gen.sample("niah_multikey", 1024, 3)
    assert c.answers != a.answers
    other = R.Generator(gen.tok, hay, seed=4).sample("niah_multikey", 1024, 2)
    assert other.answers != a.answers


def test_scorer_and_standard_error():
    assert R.string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert R.string_match_all("just 123", ["123", "456", "789", "000"]) == 0.25
    assert R.string_match_all("ABC-def", ["abc-DEF"]) == 1.0
    m, se = R.mean_se([100.0, 0.0, 100.0, 0.0])
    assert m == 50.0 and se == pytest.approx((100 * 100 * 4 / 4 / 3) ** 0.5 / 2)  # sd 57.7 / sqrt(4)
    assert R.mean_se([40.0])[1] is None


def test_bad_input(gen):
    with pytest.raises(LowbitError, match="template alone"):
        gen.sample("niah_multikey", 100, 0)
    with pytest.raises(LowbitError, match="the tasks are"):
        from lowbit.eval.ruler_task import parse_tasks

        parse_tasks("niah,cwe")


def test_length_over_the_context_is_refused():
    from lowbit.eval.ruler_task import RulerOptions, check_ruler

    with pytest.raises(LowbitError, match="context"):
        check_ruler(RulerOptions(model="smollm2-135m", lengths="4096,65536"))


def test_end_to_end_on_a_tiny_model(tiny_dir, hay, tmp_path, monkeypatch):
    from lowbit.eval.ruler_task import RulerOptions, run_ruler_eval

    hp = tmp_path / "hay.txt"
    hp.write_text(hay)
    o = RulerOptions(model=str(tiny_dir), kv="bf16,int4", peers="vllm-int8-pth", tasks="niah_multikey,vt",
                     lengths="640", trials=2, new_tokens=4, haystack=str(hp), chunk=64, dtype="fp32",
                     json_out=str(tmp_path / "r.json"), markdown_out=str(tmp_path / "r.md"), progress=False,
                     kv_flags={"sink": 0, "recent": 64})
    rep = run_ruler_eval(o)
    rows = {r["scheme"]: r for r in rep["results"]}
    assert set(rows) == {"bf16", "int4", "vllm-int8-pth"}
    assert rows["int4"]["quantized_rows"] > 0 and rows["vllm-int8-pth"]["quantized_rows"] > 0
    cell = rows["bf16"]["cells"]["vt"]["640"]
    assert cell["n"] == 2 and 0 <= cell["score"] <= 100
    assert len(rep["records"]) == 2 * 2
    assert json.loads((tmp_path / "r.json").read_text())["kind"] == "lowbit.eval.ruler"
    assert "niah_multikey @ 640" in (tmp_path / "r.md").read_text()
