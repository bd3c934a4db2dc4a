import pytest
import torch

from lowbit.calib import corpora
from lowbit.calib.corpora import load_text, token_windows
from lowbit.core.errors import LowbitError


class CharTokenizer:
    """One token per character: enough to check window cutting without a real tokenizer."""

    def __call__(self, text, add_special_tokens=True):
        ids = [ord(c) % 1000 for c in text]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_stdlib_is_english_prose_and_stable():
    t = load_text("stdlib")
    assert len(t) > 100_000 and "assert" in t and "statement" in t
    assert load_text("stdlib") == t  # deterministic (sorted topics)


def test_path_reads_utf8(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("héllo wörld", encoding="utf-8")
    assert load_text(str(p)) == "héllo wörld"


def test_non_utf8_and_missing_are_clear(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(LowbitError, match="not UTF-8"):
        load_text(p)
    with pytest.raises(LowbitError, match="neither stdlib nor wikitext2"):
        load_text(tmp_path / "nope.txt")


def test_wikitext2_missing_says_pass_data(monkeypatch, tmp_path):
    monkeypatch.setattr(corpora, "WIKITEXT2_PATH", tmp_path / "absent.raw")
    with pytest.raises(LowbitError, match="--data PATH"):
        load_text("wikitext2")


def test_windows_are_contiguous_non_overlapping_without_special_tokens():
    text = "abcdefghijklmnopqrstuvwxyz" * 3
    w = token_windows(CharTokenizer(), text, seq_len=7, n=3)
    assert w.shape == (3, 7) and w.dtype == torch.long
    flat = [ord(c) for c in text[:21]]
    assert w.flatten().tolist() == flat  # first 21 chars, no BOS


def test_too_short_corpus_errors_with_counts():
    with pytest.raises(LowbitError, match=r"has 5 tokens.*3 x 2 = 6"):
        token_windows(CharTokenizer(), "abcde", seq_len=2, n=3)
    with pytest.raises(LowbitError):
        token_windows(CharTokenizer(), "abcde", seq_len=0, n=1)


def test_wikitext2_is_found_from_the_current_directory_not_the_package(monkeypatch, tmp_path):
    # the README's layout, rebuilt around a temporary "checkout": <root>/main (cwd) beside <root>/shared
    root = tmp_path / "root"
    raw = root / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    raw.parent.mkdir(parents=True)
    raw.write_text(" = Valkyria Chronicles = \n", encoding="utf-8")
    (root / "main").mkdir()
    monkeypatch.chdir(root / "main")
    assert load_text("wikitext2") == " = Valkyria Chronicles = \n"
    assert not corpora.WIKITEXT2_PATH.is_absolute()  # not pinned to where the module was installed
    monkeypatch.chdir(tmp_path)  # elsewhere: the same default is missing and says what to do
    with pytest.raises(LowbitError, match=r"WikiText-2 is not at .*wiki.test.raw .*pass --data PATH"):
        load_text("wikitext2")


def test_wikitext2_path_argument_wins(tmp_path):
    p = tmp_path / "w.raw"
    p.write_text("seven words of text in a file", encoding="utf-8")
    assert load_text("wikitext2", wikitext2_path=p) == "seven words of text in a file"
    with pytest.raises(LowbitError, match="w2.raw"):
        load_text("wikitext2", wikitext2_path=tmp_path / "w2.raw")
