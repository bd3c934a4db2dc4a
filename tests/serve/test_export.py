"""`lowbit export --for vllm`: the directory, its sidecar, its manifest, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from lowbit.cli import main
from lowbit.core.errors import LowbitError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny smollm2-geometry HF directory (config, safetensors, tokenizer) on disk."""
    from tests.serve.conftest import tiny_runtime

    rt = tiny_runtime("bf16")
    d = tmp_path_factory.mktemp("tiny") / "tiny-smollm2"
    rt.model.save_pretrained(d)
    rt.tokenizer.save_pretrained(d)
    return d


def test_export_writes_a_pinned_vllm_dir(tiny_dir, tmp_path, capsys):
    from lowbit.artifacts import all_ok, load_manifest, verify
    from lowbit.models.geometry import ModelGeometry
    from lowbit.vllm_plugin import sidecar

    out = tmp_path / "exp"
    assert main(["export", "--for", "vllm", "--model", str(tiny_dir), "--kv", "k4v2", "--rotation", "hadamard",
                 "--out", str(out)]) == 0
    said = capsys.readouterr().out
    # it suggested the deprecated positional `lowbit serve DIR`
    assert f"or: lowbit serve --model {out}" in said and f"lowbit serve {out}" not in said
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "lowbit_kv.json", "manifest.json"} <= names
    side = sidecar.read(out)
    s = sidecar.scheme_of(side, out)
    assert (s.k.bits, s.v.bits, s.sink, s.recent, s.page, s.rotation) == (4, 2, 64, 256, 1, "hadamard")
    assert side["resolved"]["k"]["group"] == {"64": 64} and side["resolved"]["v"]["bits_per_element"] == {"64": 2.5}
    geo = ModelGeometry.from_config(json.loads((out / "config.json").read_text()))
    sidecar.check_against(side, geo)
    m = load_manifest(out)
    assert m.kind == "vllm-model" and m.artifact_class == "native-packed"
    assert m.recipe["kv"]["k"]["bits"] == 4 and m.counts["layers"] == 2
    assert all_ok(verify(out))
    # the same directory serves under lowbit's runtime with the sidecar's scheme
    from lowbit.serve.loader import load_runtime

    rt = load_runtime(str(out))
    assert rt.scheme == s and rt.name == "exp"


def test_export_refusals(tiny_dir, tmp_path):
    out = tmp_path / "x"
    base = ["export", "--for", "vllm", "--model", str(tiny_dir), "--out", str(out)]
    assert main(base + ["--kv", "int4", "--page", "16"]) == 2  # the plugin packs every token (page 1)
    assert main(base + ["--kv", "kivi2"]) == 2  # per-channel keys: not in the plugin
    assert main(base + ["--kv", "int4", "--group", "48"]) == 2  # does not divide head_dim 64
    assert main(base) == 2  # no --kv
    assert not out.exists()
    assert main(base + ["--kv", "int2"]) == 0
    assert main(base + ["--kv", "int2"]) == 2  # never overwritten


def test_sidecar_for_another_model_is_refused(tiny_dir, tmp_path):
    from lowbit.models.geometry import ModelGeometry
    from lowbit.models.tiny import tiny_config
    from lowbit.vllm_plugin import sidecar

    out = tmp_path / "e"
    assert main(["export", "--for", "vllm", "--model", str(tiny_dir), "--kv", "int4", "--out", str(out)]) == 0
    side = sidecar.read(out)
    with pytest.raises(LowbitError, match="2 layers but the model has 3"):
        sidecar.check_against(side, ModelGeometry.from_config(tiny_config("smollm2-135m", num_layers=3)))
    gemma = ModelGeometry.from_config(tiny_config("gemma3-270m", num_layers=2))
    with pytest.raises(LowbitError, match="does not match the model at layer 0"):
        sidecar.check_against(side, gemma)


def test_quantized_weights_are_served_and_exported(tiny_dir, tmp_path):
    """A compressed-tensors checkpoint (lowbit quantize's format): lowbit serve loads it through
    lowbit.weights and reports it; export --for vllm ships it with the KV sidecar."""
    from fastapi.testclient import TestClient

    from lowbit.serve.loader import load_runtime
    from lowbit.serve.server import build
    from lowbit.weights.apply import quantize_model
    from lowbit.weights.export import save_compressed
    from lowbit.weights.scheme import parse_weight_scheme
    from tests.serve.conftest import byte_tokenizer, tiny_runtime

    m = tiny_runtime("bf16").model
    s = parse_weight_scheme("w8a16")
    rep = quantize_model(m, s, method="rtn")
    ckpt = tmp_path / "ckpt"
    save_compressed(m, byte_tokenizer(), s, ckpt, inputs={"model": "tiny"}, recipe={"scheme": s.to_dict()},
                    counts=rep.counts(), ignore=["lm_head"])
    rt = load_runtime(str(tiny_dir), weights=str(ckpt))
    assert rt.weights["quantization_config"]["format"] == s.ct_format
    engine, app = build(rt, max_active=1)
    engine.start()
    try:
        with TestClient(app) as c:
            card = c.get("/v1/models").json()["data"][0]["lowbit"]
            assert card["weights"]["quantization_config"]["format"] == s.ct_format
            r = c.post("/v1/completions", json={"model": rt.name, "prompt": "hello", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
    finally:
        engine.stop()
    out = tmp_path / "exp"
    assert main(["export", "--for", "vllm", "--model", str(tiny_dir), "--kv", "int4", "--weights", str(ckpt),
                 "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == s.ct_format and (out / "lowbit_kv.json").is_file()
    rt2 = load_runtime(str(out))  # the exported dir itself: quantized weights + int4 sidecar
    assert rt2.weights is not None and rt2.scheme.k.bits == 4


def test_export_ships_a_rotation_set(tiny_dir, tmp_path):
    import torch

    from lowbit.rotation.rotation_set import RotationSet
    from lowbit.serve.loader import load_runtime
    from lowbit.vllm_plugin import sidecar

    g = torch.Generator().manual_seed(0)

    def ortho(h):  # per-KV-head random orthogonal [H, 64, 64]
        return torch.stack([torch.linalg.qr(torch.randn(64, 64, generator=g))[0] for _ in range(h)])

    rs = RotationSet(model=tiny_dir.name, k=(ortho(3), ortho(3)), v=(ortho(3), ortho(3)))
    rot = rs.save(tmp_path / "rot")
    out = tmp_path / "exp"
    assert main(["export", "--for", "vllm", "--model", str(tiny_dir), "--kv", "int4", "--rotation", str(rot),
                 "--out", str(out)]) == 0
    assert (out / "rotations" / "rotations.safetensors").is_file()
    side = sidecar.read(out)
    assert side["kv_scheme"]["rotation"]["path"] == "rotations"  # relative: the directory can move
    from lowbit.artifacts import sha256_file

    # ... and pinned by the sha256 of the shipped rotations file
    assert side["kv_scheme"]["rotation"]["sha256"] == sha256_file(out / "rotations" / "rotations.safetensors")
    rt = load_runtime(str(out))
    assert rt.scheme.rotation.path == str((out / "rotations").resolve())
    from lowbit.serve.kvcache import CacheFactory

    CacheFactory(rt.model, rt.scheme, rt.geometry)  # the cache accepts the shipped per-head rotations


def test_default_int2_export_keeps_the_std_grid_and_serves_layer_bits_padded(tiny_dir, tmp_path):
    """int2 now defaults to Hadamard + the std-placed grid: the sidecar carries both and the plugin's
    slot decodes exactly as lowbit's TensorCodec; a sidecar with per-layer bits gives each layer its own
    codec in a cell padded to the widest layer's (never one width for all)."""
    import torch

    from lowbit.kv.codec import TensorCodec
    from lowbit.vllm_plugin import sidecar
    from lowbit.vllm_plugin.slot import SlotFormat

    out = tmp_path / "int2"
    assert main(["export", "--for", "vllm", "--model", str(tiny_dir), "--kv", "int2", "--out", str(out)]) == 0
    s = sidecar.scheme_of(sidecar.read(out), out)
    assert (s.k.grid, s.v.grid, s.rotation, s.page) == ("std", "std", "hadamard", 1)
    fmt = SlotFormat(s, 64, 64)
    k = torch.randn(3, 5, 64)
    kd, _ = fmt.decode(fmt.encode(k, k).transpose(0, 1))
    c = TensorCodec(s.k, 64, 1)
    assert torch.equal(kd, c.decode(c.encode(k.transpose(0, 1)[None], torch.float16)))
    d = json.loads((out / sidecar.SIDECAR_NAME).read_text())
    d["kv_scheme"]["layer_bits"] = [[1, "int8"]]
    (out / sidecar.SIDECAR_NAME).write_text(json.dumps(d))
    from transformers import AutoConfig

    from lowbit.kv.plan import resolve
    from lowbit.models.geometry import ModelGeometry
    from lowbit.vllm_plugin.slot import layer_formats

    mixed = sidecar.scheme_of(sidecar.read(out), out)
    geometry = ModelGeometry.from_config(AutoConfig.from_pretrained(out), name=d["model"]["name"])
    fmts = layer_formats(resolve(mixed, geometry), torch.float16)
    assert [f.codecs["k"].bits for f in fmts] == [8 if i == 1 else 2 for i in range(len(fmts))]
    assert {f.slot_bytes for f in fmts} == {136}  # int8's 2 * (64 + 4): every cell padded to it
    assert fmts[0].content_bytes == 40 and fmts[1].content_bytes == 136
    kd0, _ = fmts[0].decode(fmts[0].encode(k, k).transpose(0, 1))  # a padded int2 cell still decodes exactly
    assert torch.equal(kd0, kd)


def test_export_ships_a_key_affine_and_the_plugin_plan_maps_it(tiny_dir, tmp_path):
    """A key-affine directory (what `lowbit tune` picks on biased-key models) exports like a RotationSet: copied,
    pinned, and the plan the plugin resolves from the sidecar carries each layer's map (paged.write/attend)."""
    from lowbit.calib import key_affine as kfit
    from lowbit.kv import key_affine as kam
    from lowbit.kv.plan import resolve
    from lowbit.models.geometry import ModelGeometry
    from lowbit.models.tiny import tiny_tokenizer_free_inputs
    from lowbit.vllm_plugin import sidecar
    from tests.serve.conftest import tiny_runtime

    m = tiny_runtime("bf16").model
    maps = kfit.fit(m, tiny_tokenizer_free_inputs(m.config, 2, 70, seed=11), skip=4)
    ka = kam.save(tmp_path / "ka", maps, model=tiny_dir.name)
    out = tmp_path / "exp"
    assert main(["export", "--for", "vllm", "--model", str(tiny_dir), "--kv", "int2", "--rotation", str(ka),
                 "--out", str(out)]) == 0
    side = sidecar.read(out)
    assert side["kv_scheme"]["rotation"]["path"] == "rotations"
    plan = resolve(sidecar.scheme_of(side, out), ModelGeometry.from_config(m.config, name=tiny_dir.name), device="cpu")
    for i, lp in enumerate(plan.layers):
        assert lp.k_affine is not None and torch.equal(lp.k_affine.scale, maps[i].scale)
