"""The resolved Plan: files opened once, pinned by sha256, backends chosen per layer with reasons,
and every backend that claims a layer agreeing with the torch reference on the same plan."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import lowbit.eval.layer_error
import lowbit.vllm_plugin.slot  # noqa: F401 (registers the vllm-slot backend)
from lowbit import backends
from lowbit.core.errors import LowbitError
from lowbit.kv.plan import load_levels, resolve, save_levels
from lowbit.kv.scheme import LevelsRef, RotationRef, kv_scheme_from_dict, parse_kv_scheme
from lowbit.models.geometry import ModelGeometry, geometry_of
from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.rotation.rotation_set import RotationSet
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import fast_model, rel_err, run_chunks, scheme
from .test_rotation import make_set


def _geo(model, name):
    return ModelGeometry.from_config(model.config, name=name)


def test_recipe_imports_no_rotation_or_kv_module():
    code = ("import sys, lowbit.kv.scheme; bad = sorted(m for m in sys.modules if m.startswith(('lowbit.kv', "
            "'lowbit.rotation', 'torch')) and m not in ('lowbit.kv', 'lowbit.kv.scheme')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_plan_table_for_smollm2_with_layer_bits():
    geo = geometry_of("smollm2-135m")
    plan = resolve(parse_kv_scheme("int2", layer_bits="7=int4"), geo, device="cuda")
    lines = plan.table().splitlines()
    assert len(lines) == 2 + geo.num_layers and "decode" in lines[1] and "why" in lines[1]
    row7, row6 = lines[2 + 7].split(), lines[2 + 6].split()
    assert row7[:4] == ["7", "full", "-", "int4"] and row6[3] == "int2"
    assert all(lp.backends["decode"].name == "triton-decode" for lp in plan.layers)
    cpu = resolve(parse_kv_scheme("int2"), geo, device="cpu")
    assert {lp.backends["decode"].name for lp in cpu.layers} == {"torch-stream"}
    assert "device cpu" in cpu.layers[0].backends["decode"].reason
    # a scheme the kernel cannot take: auto says why, per layer; an explicit request is refused naming the rule
    kivi = resolve(parse_kv_scheme("kivi2"), geo, device="cuda")
    assert "per channel" in kivi.layers[0].backends["decode"].reason
    with pytest.raises(LowbitError, match="cannot take layer 0: K is grouped per channel"):
        resolve(parse_kv_scheme("kivi2"), geo, device="cuda", decode_backend="triton")
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["layers"][7]["k"]["bits"] == 4 and doc["layers"][7]["backends"]["decode"]["name"] == "triton-decode"


def test_rotation_is_opened_once_and_pinned(tmp_path, monkeypatch):
    model = fast_model("smollm2-135m")
    geo = _geo(model, "smollm2-135m")
    path = make_set(geo, per_head=True).save(tmp_path / "rot")
    opened = []
    real = RotationSet.load.__func__

    def counting(cls, p, **kw):
        opened.append(str(p))
        return real(cls, p, **kw)

    monkeypatch.setattr(RotationSet, "load", classmethod(counting))
    from lowbit.serve.kvcache import CacheFactory

    factory = CacheFactory(model, scheme("int4", rotation=str(path)), geo)
    ids = tiny_tokenizer_free_inputs(model.config, 1, 20, seed=1)
    for _ in range(3):  # three served requests
        run_chunks(model, factory.new(), ids, None, [19, 1])
    assert len(opened) == 1
    sha = factory.plan.rotation_sha256
    assert factory.scheme.rotation == RotationRef(str(path), sha) and len(sha) == 64
    assert factory.plan.layers[0].rotation.startswith("per-head " + sha[:8])
    # a pinned ref that does not match the file is refused (another set saved at the same path name)
    other = make_set(geo, per_head=True, seed=7).save(tmp_path / "rot2")
    with pytest.raises(LowbitError, match="but the recipe pins"):
        resolve(scheme("int4", rotation=RotationRef(str(other), sha)), geo)


def test_levels_travel_with_the_scheme(tmp_path):
    model = fast_model("smollm2-135m")
    geo = _geo(model, "smollm2-135m")
    lv = torch.tensor([-2.0, -0.6, 0.6, 2.0])
    save_levels(tmp_path / "lv", {0: {"k": lv, "v": None}}, model=geo.name)
    s = scheme("int2", lloyd_max=True, rotation="none")
    s = replace(s, levels=LevelsRef(str(tmp_path / "lv")))
    plan = resolve(s, geo)
    assert torch.equal(plan.layers[0].k.levels, lv) and not torch.equal(plan.layers[1].k.levels, lv)
    assert plan.scheme.levels.sha256 == plan.levels_sha256 and load_levels(plan.scheme.levels, geo)[1] == plan.levels_sha256
    # it round-trips through the recipe form, pinned, and builds the same codecs
    back = resolve(kv_scheme_from_dict(json.loads(json.dumps(plan.scheme.to_dict()))), geo)
    assert torch.equal(back.layers[0].k.levels, lv)
    cache = QuantizedKVCache.from_plan(model, plan)
    assert torch.equal(cache.layers[0].k_codec.levels, lv)
    # inline levels on the tensor serialise with the scheme too
    inline = replace(s, levels=None, k=replace(s.k, levels=(-1.5, -0.5, 0.5, 1.5)))
    assert kv_scheme_from_dict(json.loads(json.dumps(inline.to_dict()))).k.levels == (-1.5, -0.5, 0.5, 1.5)
    # levels for another bit width are refused, naming the layer and the widths
    with pytest.raises(LowbitError, match="layer 0 K: the levels file holds 4 levels but the tensor is stored at 4 bits"):
        resolve(replace(scheme("int4", lloyd_max=True, rotation="none"), levels=LevelsRef(str(tmp_path / "lv"))), geo)
    with pytest.raises(LowbitError, match="3 Lloyd-Max levels given for 2-bit codes"):
        replace(s.k, levels=(0.0, 1.0, 2.0))


# Schemes covering every storage kind; each backend is run wherever it says it supports the layer.
SCHEMES = {
    "int2": {"rotation": "hadamard"},
    "k4v2": {"rotation": "none"},
    "int8": {},
    "int4-lloyd": {"lloyd_max": True, "rotation": "none"},
    "kivi2": {},
}


def _scheme(name):
    base = "int4" if name == "int4-lloyd" else name
    if base == "kivi2":
        return scheme(base, sink=4, recent=8, page=4, group=4)
    return scheme(base, **SCHEMES[name])


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_backend_that_claims_a_layer_matches_the_torch_reference(name):
    model = fast_model("gemma3-270m")
    geo = _geo(model, "gemma3-270m")
    s = _scheme(name)
    plan = resolve(s, geo, device="cpu")
    ids = tiny_tokenizer_free_inputs(model.config, 2, 31, seed=3)
    chunks = [24] + [1] * 7
    ref_cache = QuantizedKVCache.from_plan(model, plan)  # torch-stream everywhere on CPU
    ref = run_chunks(model, ref_cache, ids, None, chunks)
    claimed = set()
    # triton-decode (the Triton interpreter on CPU): the same plan's decode steps on the kernel
    kernel = backends.get("triton-decode")
    if all(kernel.why_not(lp, "decode", "cpu") is None for lp in plan.layers):
        claimed.add("triton-decode")
        kplan = resolve(s, geo, device="cpu", decode_backend="triton")
        kcache = QuantizedKVCache.from_plan(model, kplan)
        out = run_chunks(model, kcache, ids, None, chunks)
        assert kcache.backend_calls["triton"] == 7 * geo.num_layers
        assert rel_err(out, ref) < 5e-3
    # fake-quant: dequantized K/V of the middle equal the cache's own middle tier (same codec, same codes)
    fq = backends.get("fake-quant")
    for lp, layer in zip(plan.layers, ref_cache.layers):
        if fq.why_not(lp, "fake-quant", "cpu") is not None or not layer.mid_len or not lp.k.quantized:
            continue
        claimed.add("fake-quant")
        from lowbit.eval.layer_error import fake_quantize

        mk, _ = layer.middle_dequantized()
        lo, n = layer.mid_lo, layer.mid_len
        # the middle rows as stored before quantization (rotated): re-derive them from a fresh cache's ring
        k_exact = _stored_rows(model, plan, ids, chunks, lp.index, lo, n)
        fk = fake_quantize(lp.k, k_exact, sink=0)
        torch.testing.assert_close(fk, mk, rtol=0, atol=0)
    # vllm-slot: a cell written and read back holds exactly what the cache's codec decodes
    slot = backends.get("vllm-slot")
    page1 = resolve(replace(s, page=1), geo, device="cpu") if s.k.axis == "token" and s.v.axis == "token" else None
    if page1 is not None and slot.why_not(page1.layers[0], "paged", "cpu") is None:
        claimed.add("vllm-slot")
        from lowbit.vllm_plugin.slot import SlotFormat

        lp = page1.layers[0]
        g = lp.geometry
        x = torch.randn(5, g.num_kv_heads, g.head_dim_k, generator=torch.Generator().manual_seed(2))
        fmt = SlotFormat(page1.scheme, g.head_dim_k, g.head_dim_v, torch.float32)
        kh, vh = fmt.decode(fmt.encode(x, x).transpose(0, 1))
        xr = x.transpose(0, 1)[None]
        torch.testing.assert_close(kh, lp.k.decode(lp.k.encode(xr, torch.float32)), rtol=0, atol=0)
        torch.testing.assert_close(vh, lp.v.decode(lp.v.encode(xr, torch.float32)), rtol=0, atol=0)
    expected = {"int2": {"triton-decode", "fake-quant", "vllm-slot"}, "k4v2": {"triton-decode", "fake-quant", "vllm-slot"},
                "int8": {"triton-decode", "fake-quant", "vllm-slot"}, "int4-lloyd": {"fake-quant"},
                "kivi2": {"fake-quant"}}[name]
    assert claimed == expected


def _stored_rows(model, plan, ids, chunks, layer_idx, lo, n):
    """Rotated K rows [B, Hkv, n, D] slots [lo, lo + n) of layer `layer_idx`, as they entered the cache."""
    seen = []
    cache = QuantizedKVCache.from_plan(model, plan)
    layer = cache.layers[layer_idx]
    real = layer._ingest

    def spy(k, v):
        out = real(k, v)
        seen.append(out[0])
        return out

    layer._ingest = spy
    run_chunks(model, cache, ids, None, chunks)
    k = torch.cat(seen, dim=2).float()
    return k[:, :, lo:lo + n]


def test_registry_lists_every_backend_and_refuses_unknown():
    """The package's own backends are found by scanning lowbit.backends; vllm-slot and fake-quant register
    when their modules (imported at the top of this file) are imported."""
    names = set(backends.all_backends())
    assert names == {"torch-stream", "triton-decode", "vllm-slot", "fake-quant"}
    with pytest.raises(LowbitError, match="KV backend 'nope' unknown; known: fake-quant"):
        backends.get("nope")
    with pytest.raises(LowbitError, match="step kind 'train' unknown"):
        backends.supporting(None, "train", "cpu")


def test_plan_command_prints_the_table(capsys):
    from lowbit.cli import main

    assert main(["plan", "--model", "smollm2-135m", "--kv", "int2", "--layer-bits", "7=int4", "--device", "cuda"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("smollm2-135m: int2") and out[2 + 7].split()[3] == "int4"
    assert all("triton-decode" in line for line in out[2:])
    assert main(["plan", "--model", "smollm2-135m", "--kv", "kivi2", "--decode-backend", "triton", "--device", "cuda"]) == 2
    assert "per channel" in capsys.readouterr().err


def test_plan_command_plans_for_the_device_present(capsys, monkeypatch):
    # on a machine without a GPU `lowbit plan` planned for cuda (the fused kernel) unless told otherwise
    import torch

    from lowbit.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", "--model", "smollm2-135m", "--kv", "int2"]) == 0
    o = capsys.readouterr()
    assert "| device cpu," in o.out.splitlines()[0] and "triton-decode" not in o.out
    assert "note: planned for cpu (--device auto: no CUDA device here; --device cuda plans for a GPU)" in o.err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["plan", "--model", "smollm2-135m", "--kv", "int2"]) == 0
    assert "| device cuda," in capsys.readouterr().out.splitlines()[0]
