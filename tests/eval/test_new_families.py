"""`lowbit eval --model DIR` on the issue-19 families, the day a checkpoint exists.

No checkpoint of DeepseekV3 / Gemma-4 / Qwen2.5-VL can be installed here, so each is a tiny random model from
its shipped config (lowbit.models.families), saved with save_pretrained next to the word-level tokenizer: the
directory a downloaded checkpoint would be. The eval must run end to end: the bf16 row through the lowbit
cache equals the plain full-window forward, the quantized rows quantize rows. Quality numbers of random
weights mean nothing and are not asserted. The slow test runs the latent-rotation chain on DeepseekV3:
calibrate -> fit-rotations -> eval int2@ROTATION_DIR.
"""

from __future__ import annotations

import json

import pytest

from lowbit.cli import main
from lowbit.models.tiny import tiny_model, tiny_tokenizer

FAMILIES = ("deepseek-v3", "gemma4-text", "qwen2.5-vl-7b")


def _save(name, path):
    m, _ = tiny_model(name, vocab_size=99, seed=0)
    m.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _eval(model_dir, corpus, out, kv, seq_len=48):
    rc = main(["eval", "--model", str(model_dir), "--data", str(corpus), "--seq-len", str(seq_len), "--windows", "1",
               "--chunk", "16", "--dtype", "fp32", "--kv", kv, "--sink", "4", "--recent", "8", "--page", "4",
               "--no-progress", "--json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    return rep, {r["scheme"]: r for r in rep["results"]}


@pytest.mark.parametrize("name", FAMILIES)
def test_eval_runs_on_a_saved_tiny_model_of_the_family(name, corpus, tmp_path):
    d = _save(name, tmp_path / f"tiny-{name}")
    rep, rows = _eval(d, corpus, tmp_path / "r.json", "bf16,int8,int2")
    assert list(rows) == ["bf16", "int8", "int2"] and all(r["status"] == "ok" for r in rows.values())
    assert rep["full_window"]["ok"] and abs(rep["full_window"]["diff_pct"]) < 0.01  # bf16 via the cache == plain
    assert rows["bf16"]["kl"] == 0.0 and rows["int8"]["quantized_rows"] > 0 and rows["int2"]["kl"] > 0


@pytest.mark.slow
def test_latent_rotation_chain_calibrate_fit_eval(tmp_path):
    import random

    from lowbit.models.tiny import TINY_WORDS

    rng = random.Random(1)
    corpus = tmp_path / "text.txt"
    corpus.write_text(" ".join(rng.choice(TINY_WORDS) for _ in range(6000)), encoding="utf-8")
    d = _save("deepseek-v3", tmp_path / "tiny-deepseek-v3")
    calib, rot = tmp_path / "calib", tmp_path / "rot"
    # 8 x the latent's 576-wide K after the skipped sink: 39 sequences of 128
    assert main(["calibrate", "--model", str(d), "--data", str(corpus), "--tokens", "4992", "--seq-len", "128",
                 "--skip", "8", "--dtype", "fp32", "--no-progress", "--out", str(calib)]) == 0
    meta = json.loads((calib / "calibration.json").read_text())
    assert {(g["storage"], g["num_kv_heads"], g["head_dim_k"], g["head_dim_v"]) for g in meta["geometry"]} == {
        ("mla-latent", 1, 576, 512)}
    assert main(["fit-rotations", "--calib", str(calib), "--kind", "per-layer", "--model", str(d), "--no-progress",
                 "--out", str(rot)]) == 0
    _, rows = _eval(d, corpus, tmp_path / "r.json", f"bf16,int2@hadamard,int2@{rot}", seq_len=128)
    fitted = rows[f"int2@{rot}"]
    assert fitted["status"] == "ok" and fitted["config"]["rotation"] != "hadamard" and fitted["quantized_rows"] > 0
