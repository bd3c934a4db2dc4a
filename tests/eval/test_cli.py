"""`lowbit eval` end to end on a tiny local model directory, and bad input refused before model work."""

import json

import pytest

import lowbit.models
import lowbit.runtime.load
from lowbit.cli import main
from lowbit.eval.report import RESULT_KEYS


@pytest.fixture
def no_model_work(monkeypatch):
    """Fail the test if the model is loaded (bad input must be refused before)."""

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(lowbit.models, "load", refuse)
    monkeypatch.setattr(lowbit.models, "resolve", refuse)
    monkeypatch.setattr(lowbit.runtime.load, "resolve", refuse)


def _err(capsys) -> str:
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--kv", "bf16,int5"], "unknown KV scheme 'int5'"),
    (["--kv", "int4,int4"], "--kv lists int4 more than once"),
    (["--peers", "hf-quanto-int3"], "unknown peer(s) hf-quanto-int3; known peers: hf-quanto-int2"),
    (["--kv", "kivi2", "--peers", "kivi2"], "kivi2 is given both in --kv and --peers"),
    (["--data", "/no/such/corpus.txt"], "--data /no/such/corpus.txt: no such file"),
    (["--seq-len", "9000"], "--seq-len 9000 is longer than the context of smollm2-135m (8192 tokens)"),
    (["--seq-len", "1"], "--seq-len must be >= 2"),
    (["--windows", "0"], "--windows must be >= 1"),
    (["--chunk", "0"], "--chunk must be >= 1"),
    (["--plot", "out.jpg"], "the plot is a PNG"),
    (["--weights", "/no/such/dir"], "--weights /no/such/dir: no such directory"),
    (["--kv", "int4", "--clip", "1.5"], "clip ratio 1.5 is outside (0, 1]"),
    (["--kv", "int4@rotated"], "rotation 'rotated' is not none, hadamard or a RotationSet directory"),
])
def test_bad_input_refused_before_model_work(argv, message, no_model_work, capsys):
    rc = main(["eval", "--model", "smollm2-135m", "--no-progress", *argv])
    assert rc == 2
    err = _err(capsys)
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_corpus_too_short_refused_before_model_work(tiny_dir, corpus, no_model_work, capsys):
    rc = main(["eval", "--model", str(tiny_dir), "--data", str(corpus), "--seq-len", "64", "--windows", "100"])
    assert rc == 2
    assert "corpus has 3000 tokens, fewer than the 100 x 64 = 6400 asked" in _err(capsys)


def test_eval_writes_json_markdown_plot(tiny_dir, corpus, tmp_path, capsys):
    out = tmp_path / "r"
    rc = main(["eval", "--model", str(tiny_dir), "--data", str(corpus), "--seq-len", "200", "--windows", "2",
               "--chunk", "50", "--dtype", "fp32", "--kv", "bf16,int4,int2@hadamard", "--sink", "16", "--recent", "32", "--rotation", "none",
               "--peers", "hf-quanto-int2,kivi2", "--no-progress",
               "--json", str(out / "r.json"), "--markdown", str(out / "r.md"), "--plot", str(out / "r.png")])
    assert rc == 0
    rep = json.loads((out / "r.json").read_text())
    assert rep["kind"] == "lowbit.eval" and rep["schema_version"] == 1
    p = rep["protocol"]
    assert (p["windows"], p["seq_len"], p["chunk"], p["scored_per_window"], p["tokens_scored"]) == (2, 200, 50, 199, 398)
    assert "0..L-2" in p["scored_positions"]
    assert rep["versions"]["torch"] and rep["versions"]["transformers"]
    assert rep["model"]["dtype"] == "fp32" and len(rep["model"]["weights_sha256"]) == 64
    rows = {r["scheme"]: r for r in rep["results"]}
    assert list(rows) == ["bf16", "int4", "int2@hadamard", "hf-quanto-int2", "kivi2"]
    for r in rows.values():
        assert set(RESULT_KEYS) <= set(r) and r["status"] == "ok"
        assert r["tokens_scored"] == 398 and r["seconds"] > 0
    assert rows["bf16"]["delta_ppl_pct"] == 0.0 and rows["bf16"]["kl"] == 0.0 and rows["bf16"]["top1"] == 100.0
    assert rows["bf16"]["quantized_rows"] == 0 and rows["bf16"]["bits_per_elt"] is None
    for name in ("int4", "int2@hadamard", "hf-quanto-int2", "kivi2"):
        assert rows[name]["quantized_rows"] > 0 and rows[name]["kl"] > 0
    assert rows["int2@hadamard"]["config"]["rotation"] == "hadamard" and rows["int4"]["config"]["rotation"] == "none"
    assert rows["kivi2"]["config"]["recent"] == 128 and rows["kivi2"]["config"]["sink"] == 0
    assert rows["hf-quanto-int2"]["config"]["residual_length"] == 32  # = our recent window
    assert rows["int2@hadamard"]["bits_per_elt"] == pytest.approx(2.5)  # 2 + 2 x 16 / 64
    fw = rep["full_window"]
    assert fw["ok"] and abs(fw["diff_pct"]) < 0.01 and fw["chunked_ppl"] == rows["bf16"]["ppl"]
    md = (out / "r.md").read_text()
    assert "| int2@hadamard |" in md and "full-window" in md
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "int2@hadamard" in printed and "ΔPPL" in printed


def test_eval_of_a_compressed_tensors_checkpoint(tiny_dir, corpus, tmp_path):
    ckpt = tmp_path / "w8"
    assert main(["quantize", "--model", str(tiny_dir), "--weights", "w8a16", "--method", "rtn", "--calib", str(corpus),
                 "--calib-tokens", "64", "--calib-seq-len", "32", "--out", str(ckpt)]) == 0
    rc = main(["eval", "--model", str(tiny_dir), "--weights", str(ckpt), "--data", str(corpus), "--seq-len", "120",
               "--windows", "1", "--chunk", "40", "--dtype", "fp32", "--kv", "int4", "--sink", "16", "--recent", "32",
               "--no-progress", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["model"]["weights"]["dir"] == str(ckpt.resolve()) and rep["model"]["weights"]["manifest"]
    assert set(rep["model"]["weights_sha256"]) == {"model.safetensors"}
    assert [r["status"] for r in rep["results"]] == ["ok", "ok"] and rep["full_window"]["ok"]
