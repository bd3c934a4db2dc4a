"""One flag vocabulary across commands, old spellings accepted for a release with a warning."""

import argparse

import pytest

from lowbit.core.flags import deprecated, dtype_name, torch_dtype


def test_dtype_vocabulary(capsys):
    import torch

    assert [dtype_name(x) for x in ("bf16", "FP16", "fp32")] == ["bf16", "fp16", "fp32"]
    assert capsys.readouterr().err == ""
    assert dtype_name("bfloat16") == "bf16" and "use --dtype bf16" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError, match="use one of bf16, fp16, fp32"):
        dtype_name("int8")
    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("float32") is torch.float32


def test_deprecated_option_stores_into_the_new_dest(capsys):
    p = argparse.ArgumentParser()
    p.add_argument("--scheme")
    p.add_argument("--weights", dest="scheme", action=deprecated("--scheme"))
    assert p.parse_args(["--weights", "w8a16"]).scheme == "w8a16"
    assert "--weights is deprecated" in capsys.readouterr().err
    assert p.parse_args(["--scheme", "w8a16"]).scheme == "w8a16" and capsys.readouterr().err == ""


def test_serve_takes_model_as_a_flag_and_the_old_positional(capsys):
    from lowbit.commands.serve import model_from_args
    from lowbit.core.errors import LowbitError

    ns = argparse.Namespace(model=None, model_positional="smollm2-135m")
    assert model_from_args(ns) == "smollm2-135m" and "is deprecated" in capsys.readouterr().err
    with pytest.raises(LowbitError, match="give the model once"):
        model_from_args(argparse.Namespace(model="a", model_positional="b"))
    with pytest.raises(LowbitError, match="--model is required"):
        model_from_args(argparse.Namespace(model=None, model_positional=None))
