"""KVScheme: scheme strings, flags, recipe files, validation against a geometry, bits per element."""

import dataclasses
import json
from dataclasses import replace

import pytest

from lowbit.core.errors import LowbitError
from lowbit.kv.scheme import (
    DEFAULT_PAGE,
    KVScheme,
    TensorQuant,
    kv_scheme_from_dict,
    load_recipe,
    parse_kv_scheme,
)
from lowbit.models.geometry import ModelGeometry
from lowbit.models.tiny import tiny_config


def geom(name):
    return ModelGeometry.from_config(tiny_config(name, vocab_size=99), name=name)


def test_names_and_defaults():
    s = parse_kv_scheme("int4")
    assert (s.k.bits, s.v.bits, s.sink, s.recent, s.page, s.rotation) == (4, 4, 64, 256, DEFAULT_PAGE, "hadamard")
    assert s.k.grid == "minmax" and parse_kv_scheme("int8").rotation == "none"
    assert s.k.group is None and s.k.group_for(64, 16) == 64 and s.k.group_for(256, 16) == 128
    assert parse_kv_scheme("bf16").quantized is False
    assert [parse_kv_scheme(n).k.bits for n in ("int8", "int3", "int2")] == [8, 3, 2]
    kv = parse_kv_scheme("K4V2")
    assert (kv.name, kv.k.bits, kv.v.bits) == ("k4v2", 4, 2)
    assert parse_kv_scheme("k16v4").k.quantized is False
    kivi = parse_kv_scheme("kivi2")
    assert (kivi.k.axis, kivi.v.axis, kivi.v.group, kivi.recent, kivi.sink, kivi.page) == ("channel", "token", 32, 128, 0, 32)
    assert parse_kv_scheme("kivi4", group=64).page == 64  # the key block is the page


@pytest.mark.parametrize("bad", ["int5", "k5v2", "fp4", "kivi3", ""])
def test_unknown_scheme(bad):
    with pytest.raises(LowbitError):
        parse_kv_scheme(bad)


def test_flags():
    s = parse_kv_scheme("int2", group=32, sink=16, recent=32, clip="0.96,0.92", lloyd_max=False, rotation="hadamard")
    assert (s.k.group, s.v.group, s.sink, s.recent, s.k.clip, s.v.clip, s.rotation) == (32, 32, 16, 32, 0.96, 0.92, "hadamard")
    assert parse_kv_scheme("int4", clip=0.9).v.clip == 0.9
    assert parse_kv_scheme("int2", lloyd_max=True).k.lloyd_max
    with pytest.raises(LowbitError, match="needs a quantized scheme"):
        parse_kv_scheme("bf16", lloyd_max=True)
    with pytest.raises(LowbitError, match="clip"):
        parse_kv_scheme("int4", clip="1.2")
    with pytest.raises(LowbitError, match="clip"):
        parse_kv_scheme("int4", clip="a,b")
    # below one page the message offered "use 16 or 16": the lower multiple is 0 (an empty tier)
    with pytest.raises(LowbitError, match=r"sink 10 is not a multiple of the page \(16\); use 0 \(none\) or 16,"):
        parse_kv_scheme("int4", sink=10)
    with pytest.raises(LowbitError, match=r"recent 100 is not a multiple of the page \(16\); use 96 or 112,"):
        parse_kv_scheme("int4", recent=100, page=16)
    with pytest.raises(LowbitError, match="Lloyd-Max"):
        TensorQuant(bits=8, lloyd_max=True)
    with pytest.raises(LowbitError, match="bits"):
        TensorQuant(bits=5)
    with pytest.raises(LowbitError, match="axis"):
        TensorQuant(bits=4, axis="head")


def test_bits_per_element():
    assert parse_kv_scheme("int2").bits_per_element(256) == (2.25, 2.25)  # gemma3: group 128
    assert parse_kv_scheme("int2").bits_per_element(64) == (2.5, 2.5)  # smollm2: group = head_dim 64
    assert parse_kv_scheme("k4v2").bits_per_element(128) == (4.25, 2.25)
    assert parse_kv_scheme("int3").bits_per_element(128) == (4.25, 4.25)  # 4-bit containers, honestly
    assert parse_kv_scheme("kivi2").bits_per_element(64) == (3.0, 3.0)
    assert parse_kv_scheme("bf16").bits_per_element(64) == (16.0, 16.0)


def test_describe_is_one_line():
    for n in ("bf16", "int4", "k4v2", "kivi2"):
        d = parse_kv_scheme(n, rotation="hadamard").describe()
        assert "\n" not in d and d.startswith(n) and "rotation hadamard" in d


def test_validate_against_geometry():
    g, sm = geom("gemma3-270m"), geom("smollm2-135m")
    parse_kv_scheme("int2").validate(g)
    parse_kv_scheme("int2").validate(sm)
    with pytest.raises(LowbitError, match="group 96 does not divide head_dim 64"):
        parse_kv_scheme("int2", group=96).validate(sm)
    with pytest.raises(LowbitError, match="group 128 does not divide head_dim 64"):
        parse_kv_scheme("int4", group=128).validate(sm)
    odd = replace(sm, layers=[replace(sm.layers[0], attention="chunked")] + sm.layers[1:])
    with pytest.raises(LowbitError, match="attention type 'chunked' is not supported"):
        parse_kv_scheme("int4").validate(odd)
    mla = replace(sm, layers=[replace(sm.layers[0], storage="mla-latent")])
    with pytest.raises(LowbitError, match="mla-latent"):
        parse_kv_scheme("int4").validate(mla)
    nohad = replace(sm, layers=[replace(sm.layers[0], head_dim_k=52, head_dim_v=52)])
    # files and rotation orders are checked where the scheme is resolved (validate is pure data)
    from lowbit.kv.plan import resolve

    with pytest.raises(LowbitError, match="no Hadamard matrix of order 52"):
        resolve(parse_kv_scheme("int4", group=4, rotation="hadamard"), nohad)
    with pytest.raises(LowbitError, match="not found"):
        resolve(parse_kv_scheme("int4", rotation="/nonexistent/rot"), sm)
    with pytest.raises(LowbitError, match="fold_v_rotation needs a rotation"):
        parse_kv_scheme("int4", rotation="none", fold_v_rotation=True)


def test_recipe_files(tmp_path):
    j = tmp_path / "r.json"
    j.write_text(json.dumps({"kv": {"scheme": "k4v2", "group": 64, "sink": 32, "recent": 128, "clip": [1.0, 0.92],
                                    "rotation": "hadamard"}}))
    s = load_recipe(j)
    assert (s.k.bits, s.v.bits, s.k.group, s.sink, s.recent, s.v.clip, s.rotation) == (4, 2, 64, 32, 128, 0.92, "hadamard")
    t = tmp_path / "r.toml"
    t.write_text('scheme = "int2"\nlloyd_max = true\nrotation = "rots"\n[v]\nbits = 4\n')
    s2 = load_recipe(t)
    assert (s2.k.bits, s2.k.lloyd_max, s2.v.bits) == (2, True, 4)
    assert s2.rotation.path == str((tmp_path / "rots").resolve())  # relative to the recipe file
    # to_dict round trip
    s3 = parse_kv_scheme("kivi2", rotation="hadamard")
    assert kv_scheme_from_dict(s3.to_dict()) == s3
    assert kv_scheme_from_dict(s.to_dict()) == s
    bad = tmp_path / "bad.toml"
    bad.write_text('scheme = "int2"\ngroupz = 3\n')
    with pytest.raises(LowbitError, match="unknown field"):
        load_recipe(bad)
    bad.write_text("scheme = \n")
    with pytest.raises(LowbitError, match="not valid TOML"):
        load_recipe(bad)
    with pytest.raises(LowbitError, match="unknown format"):
        load_recipe(_touch(tmp_path / "r.yaml"))
    with pytest.raises(LowbitError, match="needs a 'scheme'"):
        kv_scheme_from_dict({"sink": 0})


def _touch(p):
    p.write_text("x")
    return p


def test_frozen_and_versioned():
    s = parse_kv_scheme("int4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.sink = 0
    assert s.version == 1
    with pytest.raises(LowbitError, match="version"):
        KVScheme(version=2)


def test_data_free_defaults_per_scheme():
    assert (parse_kv_scheme("int2").rotation, parse_kv_scheme("int2").k.grid) == ("hadamard", "std")
    k4v2 = parse_kv_scheme("k4v2")
    assert (k4v2.k.grid, k4v2.v.grid, k4v2.rotation) == ("minmax", "std", "hadamard")
    assert parse_kv_scheme("kivi2").rotation == "none" and parse_kv_scheme("kivi2").v.grid == "minmax"
    assert parse_kv_scheme("bf16").rotation == "none" and parse_kv_scheme("k8v8").rotation == "none"
    # asking for clip / Lloyd-Max / symmetric picks the grid those need
    assert parse_kv_scheme("int2", clip="0.96,0.92").k.grid == "minmax"
    assert parse_kv_scheme("int2", lloyd_max=True).k.grid == "minmax"
    plain = parse_kv_scheme("int2", rotation="none", grid="minmax")
    assert (plain.rotation, plain.k.grid) == ("none", "minmax")


def test_std_grid_errors():
    with pytest.raises(LowbitError, match="drop the clip"):
        parse_kv_scheme("int2", grid="std", clip=0.9)
    with pytest.raises(LowbitError, match="std grid is for"):
        parse_kv_scheme("int8", grid="std")
    with pytest.raises(LowbitError, match="grid 'bogus' unknown"):
        parse_kv_scheme("int2", grid="bogus")


@pytest.mark.parametrize(
    "value",
    ["7,18=int4;5=int8", {"7": "int4", "18": "int4", 5: "INT8"}, [[5, "int8"], [18, "int4"], [7, "int4"]]],
)
def test_layer_bits_forms(value):
    s = parse_kv_scheme("int2", layer_bits=value)
    assert s.layer_bits == ((5, "int8"), (7, "int4"), (18, "int4"))
    assert (s.for_layer(5).k.bits, s.for_layer(7).v.bits, s.for_layer(6).k.bits) == (8, 4, 2)
    assert s.for_layer(5).layer_bits == () and s.for_layer(5).k.grid == "minmax"
    assert s.for_layer(7).k.grid == "minmax"  # another width takes its own default grid
    assert parse_kv_scheme("int4", layer_bits="2=int2").for_layer(2).k.grid == "std"


@pytest.mark.parametrize(
    "value,match",
    [("7=int5", "per-layer bits 'int5' unknown"), ("7", "LAYERS=BITS"), ("x=int4", "not an integer"),
     ("7=int4;7=int8", "given twice"), ("-1=int4", "negative"), (3.5, "must be a string")],
)
def test_layer_bits_errors(value, match):
    with pytest.raises(LowbitError, match=match):
        parse_kv_scheme("int2", layer_bits=value)


def test_layer_bits_round_trip_through_files(tmp_path):
    s = parse_kv_scheme("k4v2", layer_bits="3=k8v4;1=bf16")
    j = tmp_path / "r.json"
    j.write_text(json.dumps(s.to_dict()))
    assert load_recipe(j) == s
    t = tmp_path / "r.toml"
    t.write_text('scheme = "int2"\n[layer_bits]\n"3" = "int4"\n"1" = "bf16"\n')
    assert load_recipe(t).layer_bits == ((1, "bf16"), (3, "int4"))
    assert load_recipe(t).for_layer(1).quantized is False


def test_layer_bits_validated_against_the_model():
    sm = geom("smollm2-135m")
    n = len(sm.layers)
    with pytest.raises(LowbitError, match=f"layer\\(s\\) {n} "):
        parse_kv_scheme("int2", layer_bits=f"{n}=int4").validate(sm)
    parse_kv_scheme("int2", layer_bits=f"{n - 1}=int4").validate(sm)
