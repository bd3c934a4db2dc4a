"""VQ rows end to end: `lowbit calibrate --vq-for RECIPE` fits one codebook per (layer, KV head) for the recipe's
vector-quantized tensors (and writes them as the levels artifact it names), `lowbit eval --recipe` runs it through
the real cache with held bits that count the codebooks, and the bad inputs are one-line errors before model work."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lowbit.cli import main
from lowbit.core.errors import LowbitError
from lowbit.kv.codec import TensorCodec
from lowbit.kv.held import held_bits
from lowbit.kv.plan import resolve, save_levels
from lowbit.kv.scheme import LevelsRef, TensorQuant, load_recipe, parse_kv_scheme
from lowbit.models import ModelGeometry

RECIPE = """[kv]
scheme = "int2"
rotation = "hadamard"
sink = 8
recent = 16
page = 4
zero = "none"
scale_format = "ue5m3"
k = {{ bits = 2, zero = "none", scale_format = "ue5m3", vq = "2x16" }}
v = {{ bits = 2, zero = "none", scale_format = "ue5m3", vq = "4x256" }}
{levels}
[kv.layer_bits]
"1" = "k4v2"
"""


def _geo(tiny_dir):
    return ModelGeometry.from_config(json.loads((tiny_dir / "config.json").read_text()), name=tiny_dir.name)


def test_recipe_field_validates():
    s = parse_kv_scheme("int2", zero="none", vq="2x16,none", layer_bits="1=k4v2")
    assert s.k.vq == "2x16" and s.v.vq is None and s.bits_per_element(64) == (2.25, 2.25)
    assert s.for_layer(1).k.vq is None and s.for_layer(1).k.bits == 4  # another width is a scalar grid
    for kw, match in [({"vq": "2x16"}, "set zero 'none'"), ({"vq": "2x256", "zero": "none"}, "stores 4 bits"),
                      ({"vq": "2x16", "zero": "none", "group": 32}, "no group"), ({"vq": "3x16", "zero": "none"}, "VQ spec")]:
        with pytest.raises(LowbitError, match=match) as e:
            parse_kv_scheme("int2", **kw)
        assert "\n" not in str(e.value)
    # a layer overridden to scalar widths on both tensors has no codebooks to read: its scheme drops the levels
    w = parse_kv_scheme("int2", zero="none", vq="2x16,4x256", layer_bits="1=k4v4", levels=LevelsRef("cb"))
    assert w.for_layer(1).levels is None and w.for_layer(0).levels == LevelsRef("cb")
    with pytest.raises(LowbitError, match="needs fitted codebooks"):
        TensorCodec(TensorQuant(bits=2, zero="none", vq="2x16"), 64, 16)
    with pytest.raises(LowbitError, match=r"\[H_kv, 16, 2\]"):
        TensorCodec(TensorQuant(bits=2, zero="none", vq="2x16"), 64, 16, torch.zeros(3, 16, 4))


def test_calibrate_fits_codebooks_that_eval_runs(tiny_dir, corpus, tmp_path, capsys):
    geo = _geo(tiny_dir)
    bare = tmp_path / "vq.toml"
    bare.write_text(RECIPE.format(levels=""))
    # without codebooks the plan refuses, naming the command that fits them
    with pytest.raises(LowbitError, match="lowbit calibrate --vq-for"):
        resolve(load_recipe(bare), geo)
    cb_dir = tmp_path / "cb"
    rc = main(["calibrate", "--model", str(tiny_dir), "--data", str(corpus), "--tokens", "2560", "--seq-len", "128",
               "--skip", "8", "--dtype", "fp32", "--no-progress", "--vq-for", str(bare), "--out", str(cb_dir)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    sha = out.out.split('sha256 = "')[1].split('"')[0]
    t = load_file(str(cb_dir / "levels.safetensors"))
    H = geo.layers[0].num_kv_heads
    # K of layer 1 is int4 (scalar): no codebook; every other VQ tensor has one per KV head
    assert set(t) == {"layers.0.k", "layers.0.v", "layers.1.v"}
    assert t["layers.0.k"].shape == (H, 16, 2) and t["layers.0.v"].shape == (H, 256, 4)
    assert main(["calibrate", "--model", str(tiny_dir), "--vq-for", str(bare), "--out", str(cb_dir)]) == 2  # kept

    pinned = tmp_path / "vq-pinned.toml"
    pinned.write_text(RECIPE.format(levels=f'levels = {{ path = "{cb_dir}", sha256 = "{sha}" }}'))
    s = load_recipe(pinned)
    plan = resolve(s, geo)
    assert plan.layers[0].k.vq == (2, 16) and plan.layers[1].k.vq is None
    assert "vector-quantized" in plan.layers[0].backends["decode"].reason or plan.layers[0].backends["decode"].name == "torch-stream"
    rc = main(["eval", "--model", str(tiny_dir), "--data", str(corpus), "--seq-len", "400", "--windows", "1",
               "--chunk", "40", "--dtype", "fp32", "--kv", f"bf16,int2,{pinned}", "--no-progress", "--no-full-window",
               "--json", str(tmp_path / "e.json")])
    assert rc == 0, capsys.readouterr().err
    rows = {r["scheme"]: r for r in json.loads((tmp_path / "e.json").read_text())["results"]}
    vq_row = rows["vq-pinned"]
    assert vq_row["status"] == "ok" and vq_row["quantized_rows"] > 0
    assert abs(vq_row["delta_ppl_pct"]) < 5 * max(abs(rows["int2"]["delta_ppl_pct"]), 1.0)
    # held bits: codes + one-byte row scale, plus the fp16 codebooks amortised over the rows each layer holds
    h = held_bits(plan, 400, chunk=40)
    cb_bits = h._sum("codebook_bits")
    assert cb_bits == 16 * sum(v.numel() for v in t.values())
    assert vq_row["bits_per_elt"] == pytest.approx(h.bits - cb_bits / (h._sum("elements_k") + h._sum("elements_v")),
                                                   abs=1e-3)
    # a tampered pin and codebooks of another shape are refused by name
    wrong = tmp_path / "vq-wrong.toml"
    wrong.write_text(RECIPE.format(levels=f'levels = {{ path = "{cb_dir}", sha256 = "{"0" * 64}" }}'))
    with pytest.raises(LowbitError, match="pins"):
        resolve(load_recipe(wrong), geo)
    other = save_levels(tmp_path / "cb-other", {0: {"k": torch.zeros(H, 16, 4)}}, model=tiny_dir.name)
    with pytest.raises(LowbitError, match=r"layer 0 K: .*\[H_kv, 16, 2\]"):
        resolve(parse_kv_scheme("int2", zero="none", vq="2x16,none", levels=LevelsRef(str(other))), geo)


def test_calibrate_vq_for_refuses_a_recipe_without_vq_before_model_work(tmp_path, capsys, monkeypatch):
    import lowbit.models
    import lowbit.runtime.load

    def boom(*a, **k):
        raise AssertionError("model work started")

    monkeypatch.setattr(lowbit.models, "resolve", boom)

    monkeypatch.setattr(lowbit.runtime.load, "resolve", boom)
    r = tmp_path / "plain.toml"
    r.write_text('[kv]\nscheme = "int2"\n')
    rc = main(["calibrate", "--model", "smollm2-135m", "--vq-for", str(tmp_path / "missing.toml"),
               "--out", str(tmp_path / "o")])
    assert rc == 2 and "not found" in capsys.readouterr().err
    rc = main(["calibrate", "--model", "smollm2-135m", "--vq-for", str(r), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "no vector-quantized tensor" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
