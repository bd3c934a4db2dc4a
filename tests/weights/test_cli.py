import json

import pytest
import torch

from lowbit.cli import main
from lowbit.models.tiny import tiny_tokenizer
from lowbit.weights.load import load_quantized

from .helpers import small_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "small-llama"
    small_model().save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("txt") / "calib.txt"
    p.write_text("the cat sat on the mat . a dog ran and the cat sat , " * 40, encoding="utf-8")
    return p


def test_quantize_gptq_rotate_writes_a_loadable_checkpoint(tmp_path, model_dir, calib_file, capsys):
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--model", str(model_dir), "--weights", "w4a16-g32-asym", "--method", "gptq", "--rotate",
               "--calib", str(calib_file), "--calib-tokens", "96", "--calib-seq-len", "16", "--out", str(out)])
    assert rc == 0
    assert "14 linears quantized, 1 ignored, 0 skipped" in capsys.readouterr().out
    man = json.loads((out / "manifest.json").read_text())
    assert man["class"] == "native-packed"
    assert man["counts"]["layers"] == 2 and man["counts"]["quantized_linears"] == 14
    assert man["counts"]["skipped_linears"] == 0 and man["counts"]["calibration_tokens"] == 96
    assert man["recipe"]["rotation"]["kind"] == "hadamard" and man["recipe"]["gptq"]["act_order"] == "static"
    assert man["inputs"]["calibration"]["sequences"] == 6
    files = {f["path"] for f in man["files"]}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    _, tok = load_quantized(out)
    assert tok("the cat")["input_ids"]


def test_quantize_smooth_flag_is_in_the_recipe_and_keeps_a_plain_int_checkpoint(tmp_path, model_dir, calib_file,
                                                                               capsys):
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--model", str(model_dir), "--weights", "w8a8", "--method", "rtn", "--smooth", "0.5",
               "--calib", str(calib_file), "--calib-tokens", "48", "--calib-seq-len", "16", "--out", str(out)])
    assert rc == 0 and "+smooth 0.5" in capsys.readouterr().out
    man = json.loads((out / "manifest.json").read_text())
    sm = man["recipe"]["smoothing"]
    assert sm["kind"] == "smoothquant" and sm["alpha"] == 0.5 and sm["calibration_tokens"] == 48
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "int-quantized"  # nothing new for a loader to know
    qm, _ = load_quantized(out)
    ref = small_model()
    # the smoothing went into the norms, which the checkpoint carries
    assert not torch.allclose(qm.model.layers[0].input_layernorm.weight.float(), ref.model.layers[0].input_layernorm.weight)


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--weights", "w5a16"], "unknown weight scheme 'w5a16'"),
        (["--weights", "w4a16-g64", "--method", "rtn"], "group 64 does not divide in_features 96"),
        (["--weights", "w8a16", "--calib-tokens", "100", "--calib-seq-len", "16"], "not a positive multiple"),
        (["--weights", "w8a16", "--calib-tokens", "16000", "--calib-seq-len", "16"], "fewer than the"),
        (["--weights", "w8a8", "--method", "rtn", "--smooth", "1.5"], "migration strength must be in (0, 1)"),
    ],
)
def test_bad_input_is_a_one_line_error_and_writes_nothing(tmp_path, model_dir, calib_file, capsys, args, msg):
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--model", str(model_dir), "--calib", str(calib_file), "--out", str(out), *args])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (model loading may print progress before it)
    assert rc == 2 and last.startswith("error: ") and msg in last
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_existing_output_dir_is_refused(tmp_path, model_dir, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    rc = main(["quantize", "--model", str(model_dir), "--weights", "w8a16", "--method", "rtn", "--out", str(out)])
    assert rc == 2 and "already exists" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_new_spellings_and_a_checkpoint_as_model(tmp_path, model_dir, calib_file, capsys):
    """quantize --scheme (the old --weights still works, with a deprecation line), then the checkpoint
    itself is a --model for generate (detected from its config's quantization_config)."""
    out = tmp_path / "ckpt"
    rc = main(["quantize", "--model", str(model_dir), "--scheme", "w8a16", "--method", "rtn", "--calib", str(calib_file),
               "--calib-tokens", "256", "--calib-seq-len", "32", "--dtype", "float32", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0 and "--dtype float32 is deprecated" in err and "use --dtype fp32" in err
    assert "--weights is deprecated" not in err
    rc = main(["generate", "--model", str(out), "--kv", "int4", "--prompt", "the cat", "--max-new-tokens", "3"])
    assert rc == 0
    assert "int4" in capsys.readouterr().err
    rc = main(["quantize", "--model", str(model_dir), "--weights", "w8a16", "--method", "rtn", "--out", str(tmp_path / "c2"),
               "--calib", str(calib_file), "--calib-tokens", "256", "--calib-seq-len", "32"])
    assert rc == 0 and "--weights is deprecated" in capsys.readouterr().err
    rc = main(["quantize", "--model", str(model_dir), "--out", str(tmp_path / "c3")])
    assert rc == 2 and "--scheme is required" in capsys.readouterr().err


@pytest.mark.parametrize("native, want", [(False, "float32"), (True, "bfloat16")])
def test_calib_dtype_default_follows_the_cpu_and_is_recorded(tmp_path, model_dir, calib_file, capsys, monkeypatch,
                                                              native, want):
    # bf16 autocast on a CPU without native bf16 ran GPTQ of smollm2-135m at ~2 min a layer
    import lowbit.core.device

    monkeypatch.setattr(lowbit.core.device, "cpu_native_bf16", lambda cpuinfo=None: (native, "test flags"))
    out = tmp_path / "ckpt"
    assert main(["quantize", "--model", str(model_dir), "--scheme", "w8a16", "--method", "gptq", "--calib",
                 str(calib_file), "--calib-tokens", "32", "--calib-seq-len", "16", "--device", "cpu",
                 "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"calibrating in {want} (CPU with{'' if native else 'out'} native bf16: test flags) on cpu: 2 x 16" in said
    assert f"calibrated in {want};" in said
    assert json.loads((out / "manifest.json").read_text())["recipe"]["calib_dtype"] == want
