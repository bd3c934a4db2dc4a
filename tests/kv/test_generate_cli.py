"""`lowbit generate` on a tiny model (the loader is swapped for one returning a tiny random model)."""

import pytest
import torch
from transformers import BatchEncoding

import lowbit.models
import lowbit.runtime.load
from lowbit.cli import main
from lowbit.models import LoadedModel, ModelGeometry

from .helpers import make_model


class CharTokenizer:
    """Characters -> ids in [5, 95): enough to drive generate on a 99-token tiny model."""

    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, text, return_tensors=None):
        ids = torch.tensor([[5 + ord(c) % 90 for c in text]])
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(32 + int(i) % 90) for i in ids)


@pytest.fixture
def tiny_loader(monkeypatch):
    calls = []

    def fake_load(name, **kw):
        calls.append(name)
        model = make_model("smollm2-135m", num_layers=1)
        geo = ModelGeometry.from_config(model.config, name=name)
        return LoadedModel(model=model, tokenizer=CharTokenizer(), name=name, weights_sha256="0" * 64, geometry=geo)

    monkeypatch.setattr(lowbit.models, "resolve", fake_load)

    monkeypatch.setattr(lowbit.runtime.load, "resolve", fake_load)
    return calls


def test_generate_prints_continuation_and_summary(tiny_loader, capsys):
    rc = main(["generate", "--model", "tiny", "--kv", "int2", "--sink", "4", "--recent", "8", "--page", "4",
               "--prompt", "x" * 40 + " The capital of France is", "--max-new-tokens", "6", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = out.out.strip().split("\n")
    assert lines[-1].startswith("kv int2: 70 tokens")  # 65 prompt + 5 of the 6 generated (the last is never fed back)
    assert "quantized per full layer" in lines[-1] and "middle K 2.50 / V 2.50 bits/elt" in lines[-1]
    assert len(lines[-2]) == 6  # the continuation (one char per token here)
    assert "int2: K,V int2" in out.err


def test_generate_layer_bits_and_grid_flags(tiny_loader, capsys):
    rc = main(["generate", "--model", "tiny", "--kv", "int2", "--sink", "4", "--recent", "8", "--page", "4",
               "--layer-bits", "0=int4", "--grid", "minmax", "--rotation", "none",
               "--prompt", "z" * 40, "--max-new-tokens", "3", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "middle K 4.50 / V 4.50" in out.out  # the one layer holds int4 (head_dim 64: + 2 x 16 / 64)
    assert "layers 0=int4" in out.err and "asym" in out.err and "rotation none" in out.err


def test_generate_recipe_file(tiny_loader, tmp_path, capsys):
    r = tmp_path / "kv.toml"
    r.write_text('scheme = "k4v2"\nsink = 4\nrecent = 8\npage = 4\nrotation = "hadamard"\n')
    rc = main(["generate", "--model", "tiny", "--recipe", str(r), "--prompt", "y" * 30, "--max-new-tokens", "3",
               "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "kv k4v2:" in out.out and "middle K 4.50 / V 2.50" in out.out and "rotation hadamard" in out.err


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--kv", "int4", "--recent", "10"], "multiple of the page"),
        (["--kv", "int7"], "unknown KV scheme"),
        (["--kv", "int4", "--clip", "0.9,0.8,0.7"], "clip"),
        (["--recipe", "r.toml", "--kv", "int4"], "--recipe holds the whole KV scheme"),
        (["--recipe", "r.toml", "--layer-bits", "0=int4"], "drop --layer-bits"),
        (["--kv", "int2", "--layer-bits", "0=int5"], "per-layer bits 'int5' unknown"),
        (["--kv", "int2", "--grid", "std", "--clip", "0.9"], "drop the clip ratio"),
        ([], "give a KV scheme"),
    ],
)
def test_bad_flags_fail_before_loading(tiny_loader, capsys, args, msg):
    rc = main(["generate", "--model", "tiny", "--prompt", "hi", *args])
    assert rc == 2 and msg in capsys.readouterr().err
    assert tiny_loader == []  # refused before any model was loaded


def test_bad_group_fails_at_construction(tiny_loader, capsys):
    rc = main(["generate", "--model", "tiny", "--prompt", "hi", "--kv", "int2", "--group", "96", "--device", "cpu"])
    assert rc == 2 and "group 96 does not divide head_dim 64" in capsys.readouterr().err


@pytest.fixture
def short_context_loader(monkeypatch):
    """The tiny loader with a 64-token context, and a cache class that must never be built."""
    built = []

    def fake_load(name, **kw):
        model = make_model("smollm2-135m", num_layers=1, max_position_embeddings=64)
        geo = ModelGeometry.from_config(model.config, name=name)
        return LoadedModel(model=model, tokenizer=CharTokenizer(), name=name, weights_sha256="0" * 64, geometry=geo)

    class NoCache:
        def __init__(self, *a, **kw):
            built.append(1)
            raise AssertionError("the cache was built for a prompt over the context")

    monkeypatch.setattr(lowbit.models, "resolve", fake_load)
    monkeypatch.setattr(lowbit.runtime.load, "resolve", fake_load)
    monkeypatch.setattr("lowbit.runtime.generate.QuantizedKVCache", NoCache)
    return built


def test_prompt_over_the_context_is_refused_before_any_allocation(short_context_loader, capsys):
    # a 30,858-token prompt on an 8,192-token model died allocating 34 GB in attention
    rc = main(["generate", "--model", "tiny", "--kv", "int2", "--prompt", "x" * 100, "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and short_context_loader == []
    assert err.startswith("error: the prompt is 100 tokens") and "context is 64 tokens" in err
    assert len(err.splitlines()) == 1


def test_prompt_plus_new_tokens_over_the_context_is_refused(short_context_loader, capsys):
    rc = main(["generate", "--model", "tiny", "--kv", "int2", "--prompt", "x" * 50, "--max-new-tokens", "20",
               "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and short_context_loader == []
    assert "the prompt is 50 tokens and --max-new-tokens 20 makes 70" in err and "context of 64" in err
    assert "--max-new-tokens to 14" in err


def test_non_utf8_prompt_file_is_one_line(tiny_loader, tmp_path, capsys):
    p = tmp_path / "latin1.txt"
    p.write_bytes("café crème".encode("latin-1"))
    rc = main(["generate", "--model", "tiny", "--kv", "int2", "--prompt-file", str(p), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and tiny_loader == []
    assert err.startswith(f"error: prompt file {p} is not UTF-8 text (byte 0xe9 at offset 3)")
    assert len(err.splitlines()) == 1


def test_generate_prints_speed_and_dtype(tiny_loader, capsys):
    rc = main(["generate", "--model", "tiny", "--kv", "int2", "--prompt", "hello there", "--max-new-tokens", "4",
               "--device", "cpu", "--dtype", "fp32"])
    err = capsys.readouterr().err
    assert rc == 0, err
    line = err.strip().splitlines()[-1]
    assert "fp32 (--dtype) on cpu, greedy: 11 prompt tokens, 4 new" in line
    assert "time to first token" in line and "tokens/s" in line


def test_sampling_flags_are_seeded_and_checked(tiny_loader, capsys):
    argv = ["generate", "--model", "tiny", "--kv", "int2", "--prompt", "hello there", "--max-new-tokens", "8",
            "--device", "cpu", "--temperature", "1.5", "--top-p", "0.9"]
    outs = []
    for seed in ("3", "3", "4"):
        assert main([*argv, "--seed", seed]) == 0
        o = capsys.readouterr()
        assert f"sampled (temperature 1.5, top-p 0.9, seed {seed})" in o.err
        outs.append(o.out.splitlines()[0])
    assert outs[0] == outs[1] != outs[2]  # the same seed repeats; another seed samples other tokens
    assert main(["generate", "--model", "tiny", "--kv", "int2", "--prompt", "hi", "--top-p", "0.5"]) == 2
    assert "--top-p 0.5 needs sampling: add --temperature" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--kv", "int2", "--prompt", "hi", "--seed", "1"]) == 2
    assert "--seed only matters when sampling" in capsys.readouterr().err


def test_unquantized_scheme_reports_the_dtype_it_holds(tiny_loader, capsys):
    # `--kv bf16` on an fp32 model read "32.00 bits/elt (2.000 of bf16)": the tiers keep the model dtype
    rc = main(["generate", "--model", "tiny", "--kv", "bf16", "--sink", "4", "--recent", "8", "--page", "4",
               "--prompt", "q" * 40, "--max-new-tokens", "3", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    line = out.out.strip().splitlines()[-1]
    assert "middle not quantized: K/V held in the model dtype float32 (32 / 32 bits/elt)" in line
    assert "of bf16" not in line
