"""`lowbit eval --task needle`: every row and bf16 in one run over lengths x depths, JSON / markdown /
heatmaps, accuracy relative to bf16, and bad input refused (one line) before any model work.
Tiny random models: this checks the wiring and the decode path, not retrieval quality."""

import json

import pytest
import torch

import lowbit.models
import lowbit.runtime.load
from lowbit.cli import main
from lowbit.eval import needle_task
from lowbit.eval.needle_task import chunked_greedy, parse_depths, parse_lengths

HAY = " ".join(["The cat sat on the mat.", "A dog ran to the cat.", "The dog sat and the cat ran."] * 40)


@pytest.fixture
def hay(tmp_path):
    p = tmp_path / "hay.txt"
    p.write_text(HAY, encoding="utf-8")
    return p


@pytest.fixture
def no_model_work(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(lowbit.models, "load", refuse)
    monkeypatch.setattr(lowbit.models, "resolve", refuse)
    monkeypatch.setattr(lowbit.runtime.load, "resolve", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "9000"], "--lengths 9000 is longer than the context of MODEL (8192 tokens)"),
    (["--lengths", "20"], "needle length 20 does not fit: the intro, needle and question alone take"),
    (["--lengths", "1x"], "--lengths '1x': give a comma list of whole numbers"),
    (["--depths", "0,120"], "--depths 0,120: depths are percentages of the haystack, each in 0..100"),
    (["--lengths", "100", "--kv", "int2"], "--seq-len 100 is shorter than int2's sink 64 + recent 256"),
    (["--trials", "0"], "--trials must be >= 1"),
    (["--haystack", "/no/such.txt"], "--haystack /no/such.txt: no such file"),
])
def test_bad_needle_input_refused_before_model_work(tiny_dir, hay, argv, message, no_model_work, capsys):
    argv = argv if "--haystack" in argv else [*argv, "--haystack", str(hay)]
    rc = main(["eval", "--task", "needle", "--model", str(tiny_dir), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert message.replace("MODEL", str(tiny_dir)) in err


def test_needle_flags_belong_to_the_needle_task(capsys):
    assert main(["eval", "--model", "smollm2-135m", "--lengths", "512"]) == 2
    assert "--lengths belong to --task needle" in capsys.readouterr().err


def test_parse_lengths_and_depths():
    assert parse_lengths(None, 8192, "m") == [1024, 2048] and parse_lengths(None, 1500, "m") == [1024, 1500]
    assert parse_lengths("2048,99,99", None, "m") == [99, 2048]
    assert parse_depths(None) == [float(d) for d in range(0, 101, 10)] and parse_depths("50,0") == [0.0, 50.0]


def test_chunked_greedy_reads_the_prompt_through_the_cache_like_generate(tiny_smollm):
    """bf16 (DynamicCache) fed in chunks of 7 gives the tokens model.generate gives in one prefill."""
    from transformers import DynamicCache

    from lowbit.models.tiny import tiny_tokenizer

    model, _ = tiny_smollm
    tok = tiny_tokenizer()
    prompt = "the cat sat on the mat . a dog ran to the"
    _, n, new = chunked_greedy(model, tok, DynamicCache(config=model.config), prompt, 5, chunk=7)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=1)[0, ids.shape[1]:]
    # the tiny vocabulary (99) is larger than the tokenizer's (16): ids decode to "", so no early stop
    assert n == ids.shape[1] and new == ref.tolist() and len(new) == 5


def test_needle_task_end_to_end(tiny_dir, hay, tmp_path, capsys, monkeypatch):
    # a decoder that "finds" the needle only when it stands in the first half of the prompt, and only for
    # bf16 and int4: the report's grid, accuracy and rel-to-bf16 follow what it answered
    real = needle_task.chunked_greedy
    seen = []

    def fake(model, tok, cache, prompt, n, chunk):
        answer, L, ids = real(model, tok, cache, prompt, n, chunk)  # the real path runs (and quantizes rows)
        value = prompt.split("The special magic number for ")[1].split(" is ", 1)[1].split(".")[0]
        first_half = prompt.index("The special magic") < len(prompt) / 2
        kind = type(cache).__name__
        scheme = getattr(getattr(cache, "scheme", None), "name", "bf16")
        seen.append((kind, scheme, chunk))
        return (f" {value}." if first_half and scheme in ("bf16", "int4") else answer), L, ids

    monkeypatch.setattr(needle_task, "chunked_greedy", fake)
    out = tmp_path / "o"
    rc = main(["eval", "--task", "needle", "--model", str(tiny_dir), "--dtype", "fp32", "--kv", "int4,int2",
               "--sink", "16", "--recent", "32", "--lengths", "90,130", "--depths", "0,30,80,100", "--chunk", "16",
               "--haystack", str(hay), "--no-progress", "--json", str(out / "n.json"), "--markdown", str(out / "n.md"),
               "--heatmaps", str(out / "png")])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((out / "n.json").read_text())
    assert rep["kind"] == "lowbit.eval.needle" and rep["protocol"]["lengths"] == [90, 130]
    res = {r["scheme"]: r for r in rep["results"]}
    assert list(res) == ["bf16", "int4", "int2"]
    assert res["bf16"]["grid"] == [[1.0, 1.0, 0.0, 0.0]] * 2 and res["bf16"]["accuracy"] == 0.5
    assert res["int4"]["needle_rel_bf16"] == 1.0 and res["int2"]["accuracy"] == 0.0
    assert res["int2"]["needle_rel_bf16"] == 0.0
    assert res["bf16"]["quantized_rows"] == 0 and res["int2"]["quantized_rows"] > 0
    # held bits per length, from lowbit.kv.held (int2 at 16 channels... of head_dim 64: 2 + 32/64)
    assert res["int2"]["bits_held"]["130"] == pytest.approx(2.5) and res["bf16"]["bits_held"] is None
    assert {s for _, s, _ in seen} == {"bf16", "int4", "int2"} and {c for *_, c in seen} == {16}
    assert len(rep["records"]) == 3 * 2 * 4 and all(L - 12 <= r["tokens"] <= L for r in rep["records"]
                                                    for L in [r["length"]])
    for r in rep["results"]:
        assert (out / "png" / f"needle_{r['scheme']}.png").stat().st_size > 1000
    md = (out / "n.md").read_text()
    assert "| int4 |" in md and "## int2" in md


def test_needle_runs_the_hf_quantized_cache_peer(tiny_dir, hay, tmp_path, capsys, monkeypatch):
    """transformers' QuantizedCache (quanto) is a needle row like the lowbit caches: it quantizes the prompt's rows
    past its residual length, and a peer that cannot run on the model is named before any prompt."""
    pytest.importorskip("optimum.quanto")
    out = tmp_path / "n.json"
    argv = ["eval", "--task", "needle", "--model", str(tiny_dir), "--dtype", "fp32", "--peers", "hf-quanto-int2",
            "--lengths", "300", "--depths", "50", "--chunk", "64", "--haystack", str(hay), "--no-progress"]
    assert main([*argv, "--json", str(out)]) == 0, capsys.readouterr().err
    res = {r["scheme"]: r for r in json.loads(out.read_text())["results"]}
    assert list(res) == ["bf16", "hf-quanto-int2"]
    assert res["hf-quanto-int2"]["kind"] == "hf-quantized" and res["hf-quanto-int2"]["quantized_rows"] > 0
    assert res["hf-quanto-int2"]["bits_held"] is None  # no lowbit scheme: its PPL row carries its measured bits
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optimum.quanto" else real(name, *a))
    assert main([*argv, "--json", str(tmp_path / "m.json")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the model load's progress bar
    assert last.startswith("error: hf-quanto-int2 cannot run on") and "optimum-quanto" in last
    assert not (tmp_path / "m.json").exists()
