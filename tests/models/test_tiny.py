"""Tiny random models: real geometry, forward pass, determinism."""

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.models import BUILTINS, ModelGeometry
from lowbit.models.tiny import tiny_model, tiny_tokenizer_free_inputs


def _real(name):
    return ModelGeometry.from_config(BUILTINS[name].config_dict(), name=name)


@pytest.mark.parametrize("name, n_default", [("smollm2-135m", 2), ("gemma3-270m", 6)])
def test_tiny_has_real_geometry_and_runs(name, n_default):
    model, config = tiny_model(name, vocab_size=99)
    g = ModelGeometry.from_config(config, name=name)
    assert g.num_layers == n_default
    assert g.layers == _real(name).layers[:n_default]  # same heads, head_dim, window, kinds
    assert not model.training and config._attn_implementation == "sdpa"
    ids = tiny_tokenizer_free_inputs(config, batch_size=3, seq_len=13, seed=1)
    assert ids.shape == (3, 13) and int(ids.max()) < 99
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (3, 13, 99) and torch.isfinite(logits).all()


def test_gemma_tiny_keeps_five_to_one_pattern():
    _, config = tiny_model("gemma3-270m", num_layers=13, vocab_size=99)
    g = ModelGeometry.from_config(config)
    assert g.full_layers == [5, 11] and len(g.sliding_layers) == 11
    _, config = tiny_model("gemma3-270m", num_layers=1, vocab_size=99)
    assert ModelGeometry.from_config(config).sliding_layers == [0]


def test_deterministic_per_seed_and_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a, _ = tiny_model("smollm2-135m", num_layers=1, seed=7, vocab_size=99)
    after = torch.rand(3)
    b, _ = tiny_model("smollm2-135m", num_layers=1, seed=7, vocab_size=99)
    c, _ = tiny_model("smollm2-135m", num_layers=1, seed=8, vocab_size=99)
    assert torch.equal(before, after)  # caller's RNG stream is not consumed
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    w = "model.layers.0.self_attn.k_proj.weight"
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa[w], sc[w])


def test_dtype_and_tied_embeddings():
    model, _ = tiny_model("gemma3-270m", num_layers=1, dtype=torch.bfloat16, vocab_size=99)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bad_arguments():
    with pytest.raises(LowbitError, match="vocab_size must exceed"):
        tiny_model("gemma3-270m", vocab_size=3)
    with pytest.raises(LowbitError, match="num_layers"):
        tiny_model("smollm2-135m", num_layers=0)
    with pytest.raises(LowbitError, match="built-ins are smollm2-135m, gemma3-270m"):
        tiny_model("llama-7b")


def test_tiny_tokenizer_roundtrip(tmp_path):
    from transformers import AutoTokenizer

    from lowbit.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    assert tok("the cat sat on a zebra .")["input_ids"] == [4, 5, 6, 7, 9, 0, 14]  # zebra -> <unk>
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, len(tok)) == (1, 2, 3, 16)
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)("dog ran")["input_ids"] == [10, 11]
