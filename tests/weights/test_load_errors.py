"""A damaged checkpoint is one LowbitError line that names the bad file (what `eval --weights`,
`generate`/`serve` through lowbit's loader, print), never a traceback or a list of the good files."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from lowbit.core.errors import LowbitError
from lowbit.models.tiny import tiny_tokenizer
from lowbit.weights.apply import quantize_model
from lowbit.weights.export import WEIGHTS_FILE, save_compressed
from lowbit.weights.load import load_quantized
from lowbit.weights.scheme import parse_weight_scheme

from .helpers import small_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    m = small_model(layers=1)
    s = parse_weight_scheme("w4a16-g32")
    rep = quantize_model(m, s, method="rtn")
    out = tmp_path_factory.mktemp("ckpt") / "w4"
    save_compressed(m, tiny_tokenizer(), s, out, inputs={}, recipe={}, counts=rep.counts(), ignore=["lm_head"])
    return out


def _copy(src, dst, *, manifest: bool):
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)  # artifacts are written read-only
    if not manifest:
        # without manifest.json and lowbit's header marker: a third-party (llm-compressor) dir, which
        # load_quantized takes unverified (a lowbit dir that only lost its manifest: test_lost_manifest.py)
        (dst / "manifest.json").unlink()
        save_file(load_file(dst / WEIGHTS_FILE), str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    return dst


def _truncate(f, keep: int):
    """Keep the first `keep` bytes (keep < 0: drop the last -keep bytes)."""
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    return len(data)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_manifest_mismatch_names_the_failed_file_only(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c", manifest=True)
    n = _truncate(d / WEIGHTS_FILE, 1000)
    assert n > 1000
    with pytest.raises(LowbitError) as e:
        load_quantized(d)
    msg = _one_line(e)
    assert f"{WEIGHTS_FILE} FAILED" in msg and "does not match its manifest" in msg
    # the intact files are not listed as if they were the problem
    assert "OK" not in msg.split("(", 1)[1] and "config.json" not in msg and "tokenizer" not in msg


def test_manifest_names_a_missing_and_an_unlisted_file(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c", manifest=True)
    (d / "generation_config.json").unlink()
    (d / "extra.bin").write_bytes(b"x")
    with pytest.raises(LowbitError) as e:
        load_quantized(d)
    msg = _one_line(e)
    assert "extra.bin UNLISTED" in msg and "generation_config.json MISSING" in msg and WEIGHTS_FILE not in msg


@pytest.mark.parametrize("keep", [0, 7, 100, -1, -999])  # empty, in the header length, header, tensor data
def test_truncated_safetensors_without_manifest_is_one_line_naming_it(ckpt, tmp_path, keep):
    d = _copy(ckpt, tmp_path / "c", manifest=False)
    _truncate(d / WEIGHTS_FILE, keep)
    with pytest.raises(LowbitError) as e:
        load_quantized(d)
    msg = _one_line(e)
    assert str(d / WEIGHTS_FILE) in msg and "not a readable safetensors file" in msg and "truncated" in msg


def test_intact_copy_without_manifest_still_loads(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c", manifest=False)
    model, tok = load_quantized(d)
    assert tok is not None and sum(p.numel() for p in model.parameters()) > 0
