"""A lowbit checkpoint that lost its manifest.json is refused; a plain compressed-tensors dir still loads (#22).

lowbit marks what it writes in model.safetensors' header metadata (export.MARKER_KEY), so without the
manifest load_quantized can still tell "lowbit's, unverifiable" from "llm-compressor's, nothing to verify".
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lowbit.core.errors import LowbitError
from lowbit.models.tiny import tiny_tokenizer
from lowbit.weights.apply import quantize_model
from lowbit.weights.export import ARTIFACT_KIND, MARKER_KEY, WEIGHTS_FILE, save_compressed
from lowbit.weights.load import load_quantized
from lowbit.weights.scheme import parse_weight_scheme

from .helpers import small_model, token_ids


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    m = small_model(layers=1, seed=3)
    s = parse_weight_scheme("w8a16")
    rep = quantize_model(m, s, method="rtn")
    out = tmp_path_factory.mktemp("lost") / "w8"
    save_compressed(m, tiny_tokenizer(), s, out, inputs={}, recipe={}, counts=rep.counts(), ignore=["lm_head"])
    return out


def _copy(src, dst):
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)  # artifacts are written read-only
    return dst


def _metadata(f) -> dict:
    with safe_open(str(f), framework="pt") as st:
        return st.metadata() or {}


def test_export_marks_the_safetensors_header(ckpt):
    assert _metadata(ckpt / WEIGHTS_FILE) == {"format": "pt", MARKER_KEY: ARTIFACT_KIND}


def test_lost_manifest_is_one_line_naming_it(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c")
    (d / "manifest.json").unlink()
    with pytest.raises(LowbitError) as e:
        load_quantized(d)
    msg = str(e.value)
    assert "\n" not in msg and "manifest.json is missing" in msg and WEIGHTS_FILE in msg and str(d) in msg, msg


def test_marker_in_a_second_shard_is_found_too(ckpt, tmp_path):
    """Any *.safetensors of the dir carries weight: a lowbit file next to an unmarked one is still lowbit's."""
    d = _copy(ckpt, tmp_path / "c")
    (d / "manifest.json").unlink()
    sd = load_file(d / WEIGHTS_FILE)
    keys = sorted(sd)
    (d / WEIGHTS_FILE).unlink()
    save_file({k: sd[k] for k in keys[:3]}, str(d / "a.safetensors"), metadata={"format": "pt"})
    save_file({k: sd[k] for k in keys[3:]}, str(d / "b.safetensors"), metadata={"format": "pt", MARKER_KEY: "x"})
    with pytest.raises(LowbitError, match=r"b\.safetensors.*manifest\.json is missing"):
        load_quantized(d)


def test_with_its_manifest_it_still_loads(ckpt):
    model, tok = load_quantized(ckpt)
    assert tok is not None and model(token_ids(batch=1, seq=5)).logits.shape == (1, 5, 99)


def test_plain_compressed_tensors_dir_still_loads(tmp_path):
    """Written the way llm-compressor saves (compressed-tensors' ModelCompressor + save_pretrained, no lowbit
    code): no manifest, no marker -> loads, and its logits equal compressed-tensors' own fake-quant forward."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    m = small_model(layers=1, seed=5)
    wargs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=wargs)},
                            ignore=["lm_head"], quantization_status="frozen")
    apply_quantization_config(m, qc)
    with torch.no_grad():
        for mod in m.modules():
            if getattr(mod, "quantization_scheme", None) is None:
                continue
            scale, zp = calculate_qparams(mod.weight.amin(-1, keepdim=True), mod.weight.amax(-1, keepdim=True), wargs)
            mod.weight_scale.copy_(scale)
            mod.weight_zero_point.copy_(zp)
            mod.quantization_status = QuantizationStatus.FROZEN
    x = token_ids(batch=1, seq=7, seed=1)
    with torch.no_grad():
        want = m(x).logits  # fake-quantized weights: what the compressed checkpoint holds
    comp = ModelCompressor.from_pretrained_model(m)
    comp.compress_model(m)
    out = tmp_path / "upstream-w8a16"
    m.save_pretrained(out)
    comp.update_config(out)
    assert not (out / "manifest.json").exists()
    assert all(MARKER_KEY not in _metadata(f) for f in out.glob("*.safetensors"))
    ours, _ = load_quantized(out)
    with torch.no_grad():
        got = ours(x).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())
