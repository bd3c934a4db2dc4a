"""The CUDA backend's load-time rules (no vLLM needed) and register()'s version gate for the CUDA platform."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lowbit.core.errors import LowbitError

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float16"}


def _export(tmp_path: Path, scheme) -> Path:
    from transformers import AutoConfig

    from lowbit.models.geometry import ModelGeometry
    from lowbit.vllm_plugin import sidecar

    d = tmp_path / "m"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY))
    g = ModelGeometry.from_config(AutoConfig.from_pretrained(d), name="tiny")
    sidecar.write(d, sidecar.build(scheme, g, model_name="tiny", weights_sha256=None, rotation_rel=None))
    return d


def test_load_takes_int2_int4(tmp_path):
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.vllm_plugin.cuda_model import load

    for name in ("int2", "int4", "k4v2"):
        d = _export(tmp_path / name, parse_kv_scheme(name, page=1))
        m = load(str(d), torch.float16)
        assert m.slot_bytes == m.layer_formats[0].slot_bytes and len(m.rotations) == 2


@pytest.mark.parametrize("kw,rule", [
    ({"residual": "sign", "zero": "none"}, "residual"),
    ({"zero": "none", "scale_format": "ue5m3"}, "scale-only"),
    ({"lloyd_max": True}, "Lloyd-Max"),
])
def test_load_refuses_by_name(tmp_path, kw, rule):
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.vllm_plugin.cuda_model import load

    d = _export(tmp_path, parse_kv_scheme("int2", page=1, **kw))
    with pytest.raises(LowbitError, match=rule):
        load(str(d), torch.float16)


def test_load_refuses_16bit_tensor(tmp_path):
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.vllm_plugin.cuda_model import load

    d = _export(tmp_path, parse_kv_scheme("k4v16", page=1))
    with pytest.raises(LowbitError, match="16 bits"):
        load(str(d), torch.float16)


def test_decide_cuda_series():
    from lowbit.vllm_plugin import CUDA_SERIES, decide

    d = decide(CUDA_SERIES + ".0", "cuda", False, True)
    assert d.install and d.target == "cuda"
    assert decide(CUDA_SERIES + ".1+cu129", "cuda", False, True).install
    d = decide("0.32.0", "cuda", False, True)
    assert not d.install and CUDA_SERIES in d.reason and "\n" not in d.reason
    assert decide("0.32.0", "cpu", True, False).target == "cpu"
    assert not decide("0.26.0", "rocm", False, False).install


def test_bench_export_dir(tmp_path):
    from lowbit.tools.bench import vllm_gpu as b

    d = b.make_export(tmp_path / "x", b.LLAMA3_8B, "lowbit-int2")
    assert (d / "lowbit_kv.json").is_file() and (d / "config.json").is_file()
    d = b.make_export(tmp_path / "x", b.LLAMA3_8B, "fp8")
    assert not (d / "lowbit_kv.json").exists()  # a reused directory loses its sidecar for a vLLM dtype row
    assert "entry point written" in b.ensure_entry_point(str(tmp_path))
    ep = (tmp_path / "lowbit-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]" in ep and "lowbit.vllm_plugin:register" in ep
