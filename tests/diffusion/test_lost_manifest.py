"""A DiT checkpoint that lost its manifest.json is refused by load_pipeline, naming it (#22); validate stage 1.

quantize_pipeline marks transformer/diffusion_pytorch_model.safetensors' header (lowbit.weights.export's
MARKER_KEY = diffusers-compressed-tensors), as lowbit's LM checkpoints are marked, so without the manifest
the loader can say "lowbit's, manifest lost" rather than "not lowbit's".
"""

from __future__ import annotations

import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lowbit.core.errors import LowbitError
from lowbit.weights.export import MARKER_KEY
from lowbit.weights.scheme import parse_weight_scheme
from tests.diffusion.conftest import write_tiny

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from lowbit.diffusion.quantize import quantize_pipeline

    root = tmp_path_factory.mktemp("dit-lost")
    src = write_tiny(root / "src", hidden=32, layers=1, size=8)
    quantize_pipeline(src, root / "q", component="transformer", scheme=parse_weight_scheme("w8a16"), method="rtn")
    return root / "q"


def _copy(src, dst):
    shutil.copytree(src, dst)
    for f in dst.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)  # artifacts are written read-only
    return dst


def test_quantize_marks_the_transformer_header(ckpt):
    with safe_open(str(ckpt / WEIGHTS), framework="pt") as st:
        assert st.metadata() == {"format": "pt", MARKER_KEY: "diffusers-compressed-tensors"}


def test_lost_manifest_is_one_line_naming_it(ckpt, tmp_path):
    from lowbit.diffusion.load import load_pipeline

    d = _copy(ckpt, tmp_path / "c")
    (d / "manifest.json").unlink()
    with pytest.raises(LowbitError) as e:
        load_pipeline(d)
    msg = str(e.value)
    assert "\n" not in msg and "manifest.json is missing" in msg and WEIGHTS in msg and str(d) in msg, msg


def test_unmarked_quantized_dir_without_manifest_is_still_refused(ckpt, tmp_path):
    """No marker (not lowbit's, or written before the marker): the loader's own native-packed rule refuses it."""
    from lowbit.diffusion.load import load_pipeline

    d = _copy(ckpt, tmp_path / "c")
    (d / "manifest.json").unlink()
    sd = load_file(d / WEIGHTS)
    save_file(sd, str(d / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(LowbitError, match=r"has quantized components but no manifest\.json") as e:
        load_pipeline(d)
    assert "\n" not in str(e.value)


def test_unreadable_config_without_manifest_is_named(ckpt, tmp_path):
    """Nothing to verify against: a truncated config.json is one line naming it, not a JSONDecodeError."""
    from lowbit.diffusion.load import load_pipeline

    d = _copy(ckpt, tmp_path / "c")
    (d / "manifest.json").unlink()
    cfg = d / "transformer" / "config.json"
    cfg.write_bytes(cfg.read_bytes()[:37])
    with pytest.raises(LowbitError, match=r"transformer/config\.json is not a readable JSON object"):
        load_pipeline(d)


def test_with_its_manifest_it_loads(ckpt):
    from lowbit.diffusion.load import load_pipeline
    from lowbit.weights.qlinear import QuantLinear

    pipe = load_pipeline(ckpt)
    assert sum(isinstance(m, QuantLinear) for m in pipe.transformer.modules()) == 10  # 11 linears, proj_out_2 kept
    assert pipe([3], [0], num_inference_steps=2).shape == (1, 4, 8, 8)


def test_validate_runs_stage_1_on_a_dit(ckpt):
    from lowbit.tools.validate import DIT_STAGES_WHY, Options, validate

    rep = validate(Options(artifact=str(ckpt), device="cpu"))
    assert rep["ok"] and rep["kind"] == "dit" and [r["stage"] for r in rep["stages"]] == [1], rep["error"]
    checks = {c["name"]: c for c in rep["stages"][0]["checks"]}
    assert {"digests", "class", "pipeline", "weights", "manifest recipe"} <= set(checks)
    assert "w8a16: 10 quantized linears" in checks["weights"]["detail"]
    assert [(s["stage"], s["why"]) for s in rep["skipped"]] == [(n, DIT_STAGES_WHY) for n in (2, 3, 4)]
    with pytest.raises(LowbitError, match="--base is for weights and kv-export artifacts but .* is dit"):
        validate(Options(artifact=str(ckpt), device="cpu", base="x"))
