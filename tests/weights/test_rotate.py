import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.models.tiny import tiny_model, tiny_tokenizer_free_inputs
from lowbit.weights.rotate import fuse_norms, rotate_model

from .helpers import small_model, token_ids


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_rotated_fp32_model_gives_the_same_logits(model_type):
    m = small_model(model_type)
    ids = token_ids()
    ref = m(ids).logits
    info = rotate_model(m)
    out = m(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert info["residual_dim"] == 96 and m.config.tie_word_embeddings is False
    # the rotation really changed the weights (and norms are fused to 1)
    assert torch.all(m.model.layers[0].input_layernorm.weight == 1)
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()


def test_smollm2_geometry_576_non_power_of_two_hadamard():
    m, cfg = tiny_model("smollm2-135m", num_layers=1, vocab_size=99)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    ids = tiny_tokenizer_free_inputs(cfg, 2, 11)
    ref = m(ids).logits
    w0 = m.model.layers[0].self_attn.q_proj.weight.clone()
    rotate_model(m)
    torch.testing.assert_close(m(ids).logits, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(m.model.layers[0].self_attn.q_proj.weight, w0)


def test_fusing_norms_alone_keeps_logits():
    m = small_model("llama", tie=False)
    ids = token_ids(seed=2)
    ref = m(ids).logits
    fuse_norms(m)
    torch.testing.assert_close(m(ids).logits, ref, atol=1e-5, rtol=1e-5)


def test_gemma3_is_refused_with_the_reason():
    m, _ = tiny_model("gemma3-270m", num_layers=1, vocab_size=99)
    w0 = m.model.embed_tokens.weight.clone()
    with pytest.raises(LowbitError, match="not supported on gemma3.*norms"):
        rotate_model(m)
    assert torch.equal(m.model.embed_tokens.weight, w0)  # refused before touching anything


def test_unknown_architecture_is_refused():
    m = small_model("llama")
    m.config.model_type = "mystery"
    with pytest.raises(LowbitError, match="does not know architecture 'mystery'"):
        rotate_model(m)
