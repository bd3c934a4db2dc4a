import json

import pytest
import torch

from lowbit.artifacts import load_manifest
from lowbit.core.errors import LowbitError
from lowbit.models.tiny import tiny_tokenizer
from lowbit.weights.apply import quantize_model
from lowbit.weights.export import checkpoint_state, save_compressed
from lowbit.weights.load import load_quantized, scheme_from_ct
from lowbit.weights.qlinear import QuantLinear
from lowbit.weights.scheme import parse_weight_scheme

from .helpers import small_model, token_ids

SCHEMES = ["w4a16-g32-asym", "w4a16-g32", "w8a16", "w8a8", "w4a8-g32"]


def _quantized(scheme, rotate=False, tie=True):
    m = small_model(tie=tie)
    s = parse_weight_scheme(scheme)
    rep = quantize_model(m, s, method="rtn", rotate=rotate)
    return m, s, rep


def _save(m, s, rep, out):
    return save_compressed(m, tiny_tokenizer(), s, out, inputs={"model": "small"}, recipe={"scheme": s.to_dict()},
                           counts=rep.counts(), ignore=["lm_head"])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_roundtrip_through_lowbit_loader_is_exact(tmp_path, scheme):
    m, s, rep = _quantized(scheme, rotate=True)
    ids = token_ids(seed=3)
    ref = m(ids).logits
    out = tmp_path / "ckpt"
    man = _save(m, s, rep, out)
    assert man.counts["quantized_linears"] == 14 and man.counts["skipped_linears"] == 0
    assert man.artifact_class == "native-packed" if hasattr(man, "artifact_class") else True
    m2, tok = load_quantized(out)
    assert isinstance(m2.model.layers[0].mlp.up_proj, QuantLinear) and tok is not None
    torch.testing.assert_close(m2(ids).logits, ref, atol=0, rtol=0)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["format"] == s.ct_format and qc["ignore"] == ["lm_head"] and qc["quantization_status"] == "compressed"
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert scheme_from_ct(qc) == s


def test_safetensors_layout(tmp_path):
    m, _, _ = _quantized("w4a16-g32-asym")
    sd = checkpoint_state(m, torch.float32)
    p = "model.layers.0.mlp.down_proj"  # [96, 160]
    assert sd[f"{p}.weight_packed"].dtype == torch.int32 and sd[f"{p}.weight_packed"].shape == (96, 160 * 4 // 32)
    assert sd[f"{p}.weight_scale"].shape == (96, 5)
    assert sd[f"{p}.weight_zero_point"].shape == (96 * 4 // 32, 5)
    assert sd[f"{p}.weight_shape"].tolist() == [96, 160]
    assert f"{p}.weight" not in sd and "lm_head.weight" not in sd  # tied lm_head stored once
    sd8 = checkpoint_state(_quantized("w8a8")[0], torch.float32)
    assert sd8[f"{p}.weight"].dtype == torch.int8 and sd8[f"{p}.weight_scale"].shape == (96, 1)
    assert f"{p}.weight_zero_point" not in sd8


@pytest.mark.parametrize("scheme", ["w4a16-g32-asym", "w8a16", "w4a16-g32"])
def test_compressed_tensors_decompressor_gives_our_weights(tmp_path, scheme):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from lowbit.weights.export import ct_quantization_config

    m, s, _ = _quantized(scheme)
    qs = QuantizationScheme.model_validate(ct_quantization_config(s, ["lm_head"])["config_groups"]["group_0"])
    p = "model.layers.1.self_attn.o_proj"
    sd = {k[len(p) + 1:]: v for k, v in checkpoint_state(m, torch.float32).items() if k.startswith(p + ".")}
    dense = PackedQuantizationCompressor.decompress(sd, qs)["weight"]
    ql = m.get_submodule(p)
    torch.testing.assert_close(dense.float(), ql.dequantized_weight(), atol=0, rtol=0)


@pytest.mark.parametrize("scheme", ["w4a16-g32-asym", "w4a16-g32", "w8a16", "w8a8"])
def test_transformers_from_pretrained_loads_it(tmp_path, scheme):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    m, s, rep = _quantized(scheme, rotate=True)
    ids = token_ids(seed=4)
    ref = m(ids).logits
    out = tmp_path / "ckpt"
    _save(m, s, rep, out)
    # asymmetric W4 (weight_zero_point) needs dequantize=True in transformers 5.24; it works for all
    hf = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    got = hf(ids).logits
    a8_applied = any(getattr(getattr(x, "quantization_scheme", None), "input_activations", None) is not None
                     for x in hf.modules())
    if s.a_bits == 16:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    elif a8_applied:  # transformers 5.17: dequantize=True still fake-quantizes the inputs, as lowbit does
        assert torch.equal(got, ref)
    else:
        # transformers 5.24: dequantize=True keeps the model dense (its compressed-tensors quantizer skips
        # apply_quantization_config), so this is a8 against a16. The plain load (test_plain_load) runs
        # compressed-tensors' a8 there and equals lowbit's bit for bit.
        assert 0 < float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())


def test_existing_output_is_refused_and_failed_write_leaves_nothing(tmp_path):
    m, s, rep = _quantized("w8a16")
    out = tmp_path / "ckpt"
    out.mkdir()
    with pytest.raises(LowbitError, match="already exists"):
        _save(m, s, rep, out)
    out2 = tmp_path / "ckpt2"

    class BadTok:
        def save_pretrained(self, path):
            raise OSError("disk full")

    with pytest.raises(OSError):
        save_compressed(m, BadTok(), s, out2, inputs={}, recipe={}, counts={}, ignore=["lm_head"])
    assert not out2.exists() and list(tmp_path.iterdir()) == [out]  # no partial checkpoint, no staging left


def test_loader_refuses_a_tampered_checkpoint(tmp_path):
    m, s, rep = _quantized("w8a16")
    out = tmp_path / "ckpt"
    _save(m, s, rep, out)
    assert load_manifest(out).counts["layers"] == 2
    (out / "model.safetensors").chmod(0o644)
    with open(out / "model.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(LowbitError, match="does not match its manifest"):
        load_quantized(out)
