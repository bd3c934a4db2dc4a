import json

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.weights.qlinear import QuantLinear
from lowbit.weights.scheme import parse_weight_scheme
from tests.diffusion.conftest import write_tiny

LINEARS = 2 * 9 + 2  # per block: q k v out, ff x2, adaLN, timestep MLP x2; + proj_out_1, proj_out_2


@pytest.mark.parametrize("name,method", [("w8a16", "rtn"), ("w8a8", "rtn"), ("w4a16-g64", "gptq")])
def test_quantize_reload_bit_exact(tiny_dir, tmp_path, name, method):
    from lowbit.artifacts import load_manifest, sha256_file, verify
    from lowbit.diffusion.load import load_pipeline
    from lowbit.diffusion.quantize import CalibSpec, quantize_pipeline, quantize_transformer

    out = tmp_path / "q"
    cal = CalibSpec(classes=(1, 4, 9), seeds=(1000,), steps=3)
    m = quantize_pipeline(tiny_dir, out, component="transformer", scheme=parse_weight_scheme(name), method=method,
                          calib=cal)
    c = m["counts"]
    assert (c["linears"], c["quantized_linears"], c["skipped_linears"], c["ignored"]) == (
        LINEARS, LINEARS - 1, 0, ["proj_out_2"])
    assert m["class"] == "native-packed"
    assert all(s.status == "OK" for s in verify(out))
    # the rest is untouched: same bytes as the source, and listed in the manifest
    assert sha256_file(out / "scheduler" / "scheduler_config.json") == sha256_file(
        tiny_dir / "scheduler" / "scheduler_config.json")
    listed = {f.path for f in load_manifest(out).files}
    assert {"model_index.json", "scheduler/scheduler_config.json", "transformer/config.json"} <= listed
    assert not (out / "samples.png").exists()
    qc = json.loads((out / "transformer" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["proj_out_2"]

    # in memory (the quantizer's modules) vs reloaded from disk: identical images, bit for bit
    mem = load_pipeline(tiny_dir)
    quantize_transformer(mem, parse_weight_scheme(name), method=method, calib=cal)
    disk = load_pipeline(out)
    assert sum(isinstance(x, QuantLinear) for x in disk.transformer.modules()) == LINEARS - 1
    a = mem([2, 7, 7], [0, 5, 6], num_inference_steps=4)
    b = disk([2, 7, 7], [0, 5, 6], num_inference_steps=4)
    assert torch.equal(a, b)
    ref = load_pipeline(tiny_dir)([2, 7, 7], [0, 5, 6], num_inference_steps=4)
    assert not torch.equal(a, ref)  # it really is quantized


def test_ignore_nothing_quantizes_every_linear(tiny_dir, tmp_path):
    from lowbit.diffusion.quantize import quantize_pipeline

    m = quantize_pipeline(tiny_dir, tmp_path / "q", component="transformer", scheme=parse_weight_scheme("w8a16"),
                          ignore=[])
    assert (m["counts"]["quantized_linears"], m["counts"]["ignored_linears"]) == (LINEARS, 0)


def test_cli_quantize_and_bad_input(tiny_dir, tmp_path, capsys):
    from lowbit.cli import main

    out = tmp_path / "cli"
    assert main(["quantize", "--model", str(tiny_dir), "--component", "transformer", "--scheme", "w4a16-g64",
                 "--method", "rtn", "--out", str(out)]) == 0
    assert "19 of 20 linears quantized, 1 ignored (proj_out_2), 0 skipped" in capsys.readouterr().out
    bad = tmp_path / "bad"
    # a component the pipeline lacks
    assert main(["quantize", "--model", str(tiny_dir), "--component", "vae", "--scheme", "w8a16",
                 "--out", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "no component 'vae'" in err and len(err.strip().splitlines()) == 1
    # a diffusers dir without --component
    assert main(["quantize", "--model", str(tiny_dir), "--scheme", "w8a16", "--out", str(bad)]) == 2
    assert "--component transformer" in capsys.readouterr().err
    # an already quantized pipeline
    assert main(["quantize", "--model", str(out), "--component", "transformer", "--scheme", "w8a16",
                 "--out", str(bad)]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert not bad.exists() and not list(tmp_path.glob(".bad*"))


def test_group_that_does_not_divide_is_named_and_nothing_written(tmp_path):
    from lowbit.diffusion.quantize import quantize_pipeline

    src = write_tiny(tmp_path / "h96", hidden=96, heads=3)
    with pytest.raises(LowbitError, match=r"^transformer_blocks\.0\.\S+: scheme w4a16-g64: group 64 "
                                          r"does not divide in_features 96"):
        quantize_pipeline(src, tmp_path / "q", component="transformer", scheme=parse_weight_scheme("w4a16-g64"))
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q*"))


def test_loader_refuses_damage_and_wrong_class(tiny_dir, tmp_path):
    import shutil

    from lowbit.diffusion.load import load_pipeline
    from lowbit.diffusion.quantize import quantize_pipeline

    out = tmp_path / "q"
    quantize_pipeline(tiny_dir, out, component="transformer", scheme=parse_weight_scheme("w8a16"))
    f = out / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(LowbitError, match="diffusion_pytorch_model.safetensors"):
        load_pipeline(out)
    # quantized components without their manifest (lowbit's header marker names the loss; unmarked dirs:
    # tests/diffusion/test_lost_manifest.py)
    plain = tmp_path / "plain"
    shutil.copytree(out, plain)
    (plain / "manifest.json").unlink()
    with pytest.raises(LowbitError, match="written by lowbit .* but its manifest.json is missing"):
        load_pipeline(plain)


def test_bf16_activations_keep_the_quantized_scales(tiny_dir, tmp_path):
    from lowbit.diffusion.gate import psnr
    from lowbit.diffusion.load import load_pipeline
    from lowbit.diffusion.quantize import quantize_pipeline

    out = tmp_path / "q"
    quantize_pipeline(tiny_dir, out, component="transformer", scheme=parse_weight_scheme("w4a16-g64"))
    p32, p16 = load_pipeline(out), load_pipeline(out, dtype=torch.bfloat16)
    q = [m for m in p16.transformer.modules() if isinstance(m, QuantLinear)]
    assert q and all(m.scale.dtype == torch.float32 for m in q)
    assert p16.transformer.pos_embed.proj.weight.dtype == torch.bfloat16
    a, b = p32([1, 2], [0, 1], num_inference_steps=3), p16([1, 2], [0, 1], num_inference_steps=3)
    assert torch.isfinite(b).all() and psnr(a, b) > 20
