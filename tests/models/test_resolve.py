"""lowbit.runtime.load.resolve (lowbit.models.resolve + quantized checkpoints): one answer to 'name or dir -> model, tokenizer, geometry, provenance'."""

import json

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.models import (
    BUILTINS,
    TOKENIZER_FILES,
    has_tokenizer,
    is_quantized_checkpoint,
    load_tokenizer,
    model_dir,
    model_name,
)
from lowbit.models import resolve as resolve_plain
from lowbit.models.load import is_cached, sha256_file
from lowbit.models.tiny import tiny_model, tiny_tokenizer
from lowbit.runtime.load import resolve

from .test_load import toy  # noqa: F401 (fixture: a fake built-in, no GGUF)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A local HF dir: 3-layer tiny smollm2 (vocab 99) + the word-level test tokenizer."""
    model, _ = tiny_model("smollm2-135m", num_layers=3, seed=7, vocab_size=99)
    d = tmp_path_factory.mktemp("resolve") / "tiny-llama"
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d, model


def test_local_dir_gives_model_tokenizer_geometry_provenance(hf_dir, tmp_path):
    d, ref = hf_dir
    lm = resolve(d, cache_dir=tmp_path, dtype=torch.bfloat16)
    assert lm.name == "tiny-llama" and lm.path == d and lm.geometry.name == "tiny-llama"
    assert lm.geometry.num_layers == 3 and lm.geometry.layers[1].num_kv_heads == 3
    assert lm.model.model.embed_tokens.weight.dtype == torch.bfloat16 and not lm.model.training
    assert lm.tokenizer("the cat sat")["input_ids"] == [4, 5, 6]
    sha = sha256_file(d / "model.safetensors")
    assert lm.weights_sha256 == sha
    assert lm.provenance == {"source": "dir", "path": str(d.resolve()), "weights_sha256": sha,
                             "weights_files": {"model.safetensors": sha}}
    json.dumps(lm.provenance)  # JSON-ready, goes into reports and manifests
    ids = torch.tensor([[4, 5, 6, 98, 1]])
    with torch.no_grad():
        torch.testing.assert_close(resolve(str(d), cache_dir=tmp_path).model(ids).logits, ref(ids).logits)


def test_tokenizer_without_weights_and_one_file_list(hf_dir, tmp_path):
    d, _ = hf_dir
    assert has_tokenizer(d) and load_tokenizer(d)("the dog ran")["input_ids"] == [4, 10, 11]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "merges.txt").write_text("#version: 0.2\n")  # travels with a tokenizer but is not one
    assert not has_tokenizer(bare) and load_tokenizer(bare) is None
    assert load_tokenizer(tmp_path / "missing") is None
    assert "merges.txt" in TOKENIZER_FILES and "tokenizer.json" in TOKENIZER_FILES
    assert model_dir(d) == d and model_name(str(d) + "/") == "tiny-llama"
    assert not is_quantized_checkpoint(d) and not is_quantized_checkpoint(bare)


def test_quantized_checkpoint_loads_through_lowbit_weights(hf_dir, tmp_path, capsys):
    from lowbit.cli import main
    from lowbit.weights.apply import quantize_model
    from lowbit.weights.export import save_compressed
    from lowbit.weights.qlinear import QuantLinear
    from lowbit.weights.scheme import parse_weight_scheme

    model, _ = tiny_model("smollm2-135m", num_layers=1, seed=3, vocab_size=99)
    s = parse_weight_scheme("w8a16")
    rep = quantize_model(model, s, method="rtn")
    ckpt = tmp_path / "ckpt-w8"
    save_compressed(model, tiny_tokenizer(), s, ckpt, inputs={"model": "tiny"}, recipe={"scheme": s.to_dict()},
                    counts=rep.counts(), ignore=["lm_head"])
    assert is_quantized_checkpoint(ckpt)
    # models sit below weights: lowbit.models.resolve refuses it and says where it opens
    with pytest.raises(LowbitError, match="quantized checkpoint .* lowbit.runtime.load.resolve"):
        resolve_plain(ckpt, cache_dir=tmp_path / "cache")
    lm = resolve(ckpt, cache_dir=tmp_path / "cache")
    assert lm.provenance["source"] == "quantized-checkpoint" and lm.provenance["manifest"] is True
    assert lm.provenance["quantization_config"]["format"] == s.ct_format
    assert sum(isinstance(m, QuantLinear) for m in lm.model.modules()) == 7  # q k v o gate up down
    assert lm.name == "ckpt-w8" and lm.geometry.num_layers == 1 and lm.tokenizer is not None
    ids = torch.tensor([[4, 5, 6, 9]])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    # quantizing it again is refused (one line), nothing written
    assert main(["quantize", "--model", str(ckpt), "--weights", "w8a16", "--method", "rtn",
                 "--out", str(tmp_path / "again")]) == 2
    assert "is already a quantized checkpoint" in capsys.readouterr().err and not (tmp_path / "again").exists()


@pytest.mark.parametrize("kind, msg", [
    ("missing", "no such directory: .*nowhere; pass a Hugging Face model directory or a built-in name"),
    ("empty", "has no config.json: pass a Hugging Face model directory"),
    ("file", "is a file: pass a Hugging Face model directory"),
    ("bad-json", r"config.json is not valid JSON \(Expecting property name .* at line 1 column 2\); restore it"),
    ("truncated", r"model.safetensors is damaged \(its header describes \d+ bytes but the file has \d+ \(truncated"),
    ("not-safetensors", r"model.safetensors is damaged \(header of \d+ bytes but the file has 12"),
])
def test_bad_path_is_a_one_line_error(tmp_path, kind, msg):
    bad = tmp_path / {"missing": "nowhere", "empty": "empty", "file": "w.gguf"}.get(kind, kind)
    if kind == "empty":
        bad.mkdir()
    elif kind == "file":
        bad.write_bytes(b"")
    elif kind in ("bad-json", "truncated", "not-safetensors"):  # a plain HF dir, then damaged
        model, _ = tiny_model("smollm2-135m", num_layers=1, vocab_size=99)
        model.save_pretrained(bad)
        w = bad / "model.safetensors"
        if kind == "bad-json":
            (bad / "config.json").write_text("{not json")
        elif kind == "truncated":
            w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
        else:
            w.write_bytes(b"not a tensor")
    before = sorted(tmp_path.iterdir())
    with pytest.raises(LowbitError, match=msg) as e:
        resolve(bad, cache_dir=tmp_path)
    assert "\n" not in str(e.value)
    assert sorted(tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_when_cached(name):
    if not is_cached(name):
        pytest.skip(f"{name} is not converted into ~/.cache/lowbit yet")
    lm = resolve(name)
    assert lm.name == name == lm.geometry.name and lm.provenance["source"] == "builtin"
    assert lm.provenance["weights_sha256"] == lm.weights_sha256 == sha256_file(lm.path / "model.safetensors")
    assert lm.provenance["distribution"] == BUILTINS[name].distribution and lm.tokenizer is not None
    assert model_dir(name) == lm.path and load_tokenizer(name) is not None


def test_builtin_provenance_and_model_dir_share_the_cache(tmp_path, toy):  # noqa: F811
    d = model_dir("toy", cache_dir=tmp_path)  # converts once, loads nothing
    assert d == tmp_path / "toy" and toy == ["toy"]
    lm = resolve("toy", cache_dir=tmp_path)
    assert toy == ["toy"] and lm.path == d and lm.name == "toy" == model_name("toy")
    meta = json.loads((d / "lowbit.json").read_text())
    assert lm.provenance == {"source": "builtin", "path": str(d), "weights_sha256": meta["weights_sha256"],
                             "weights_files": {"model.safetensors": meta["weights_sha256"]},
                             "distribution": "pytest", "version": meta["source"]["version"], "hf_id": "toy"}
    assert load_tokenizer("toy", cache_dir=tmp_path)("the mat")["input_ids"] == [4, 8]
    assert load_tokenizer("toy", cache_dir=tmp_path / "elsewhere") is None  # not cached there: no conversion
    assert toy == ["toy"]
