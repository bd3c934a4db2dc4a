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


AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    from lowbit.core.device import cpu_native_bf16, default_dtype

    assert cpu_native_bf16(AVX2_ONLY) == (False, "no avx512_bf16/amx_bf16/bf16 flag in /proc/cpuinfo")
    assert cpu_native_bf16(AMX) == (True, "CPU flags avx512_bf16+amx_bf16 in /proc/cpuinfo")
    assert cpu_native_bf16(ARM)[0] is True
    # the AVX2-only CPU ran bf16 5.7x slower than fp32: auto means fp32 there
    why = "CPU without native bf16: no avx512_bf16/amx_bf16/bf16 flag in /proc/cpuinfo"
    assert default_dtype("cpu", AVX2_ONLY) == ("fp32", why)
    assert default_dtype("cpu", AMX)[0] == "bf16" and default_dtype("cuda", AVX2_ONLY) == ("bf16", "CUDA")


def test_resolve_dtype_keeps_an_explicit_choice(monkeypatch):
    import lowbit.core.device
    from lowbit.core.flags import resolve_dtype

    monkeypatch.setattr(lowbit.core.device, "cpu_native_bf16", lambda cpuinfo=None: (False, "x"))
    assert resolve_dtype("auto", "cpu") == ("fp32", "CPU without native bf16: x")
    assert resolve_dtype("bf16", "cpu") == ("bf16", "--dtype")
    assert resolve_dtype("auto", "cuda:1") == ("bf16", "CUDA")
    assert dtype_name("auto") == "auto"


@pytest.mark.parametrize("argv", [["eval", "--model", "m", "--kv", "int2"], ["demo", "--model", "m"]])
def test_eval_and_demo_default_to_fp32_on_a_cpu_without_bf16(argv, monkeypatch):
    # `lowbit eval` / `lowbit demo` ran bf16 on an AVX2-only CPU: 5.7x slower than fp32 (the demo took 17 minutes)
    import lowbit.core.device
    import lowbit.eval.runner
    from lowbit.cli import main

    seen = []

    class Stop(Exception):
        pass

    def fake_check(o):
        seen.append(o.dtype)
        raise Stop

    monkeypatch.setattr(lowbit.core.device, "cpu_native_bf16", lambda cpuinfo=None: (False, "x"))
    monkeypatch.setattr(lowbit.eval.runner, "check_options", fake_check)
    monkeypatch.setattr(lowbit.eval.runner, "run_eval", lambda o, **kw: fake_check(o))
    with pytest.raises(Stop):
        main(argv)
    assert seen == ["fp32"]
