"""`lowbit tune`: the greedy allocation respects the held-bits budget and spends bits where the measured
loss drops most per held bit; bad input refused before model work; the written recipe loads and runs in
`lowbit eval --recipe`; shipped recipes resolve by name, pinned by sha256."""

import hashlib
import json
from pathlib import Path

import pytest

import lowbit.models
import lowbit.recipes
import lowbit.runtime.load
from lowbit.cli import main
from lowbit.core.errors import LowbitError
from lowbit.eval.plan import plan_schemes
from lowbit.eval.tune import allocate
from lowbit.kv.held import held_bits
from lowbit.kv.scheme import load_recipe
from lowbit.models import ModelGeometry


def test_allocate_spends_bits_where_loss_drops_most_per_held_bit():
    # 3 layers; layer 2 holds 8x the elements of the others (a full layer among sliding ones)
    elems = {0: (100, 100), 1: (100, 100), 2: (800, 800)}
    cost = {(i, b): (b + 0.5, b + 0.5) for i in range(3) for b in (2, 4, 8)}
    err = {}
    for i in range(3):
        for t in (0, 1):
            base = {0: 1.0, 1: 0.1, 2: 2.0}[i] * (3.0 if t == 1 else 1.0)  # V hurts more than K here
            err.update({(i, t, 2): base, (i, t, 4): base / 16, (i, t, 8): base / 256})
    total = sum(sum(e) for e in elems.values())
    for budget in (2.5, 2.7, 3.0, 3.5, 9.0):
        assign, _, held = allocate(err, elems, cost, budget, [0, 1, 2])
        want = sum(elems[i][t] * cost[(i, assign[i][t])][t] for i in range(3) for t in (0, 1)) / total
        assert held == pytest.approx(want) and held <= budget + 1e-9
    # 0.1 spare bits buy one cheap tensor 2 -> 4: layer 0's V (the largest loss drop per bit); 0.2 also its K
    # (9.4 per 0.1 bit beats layer 1's V, 2.8); layer 2 (8x the elements) stays at 2 bits
    assert allocate(err, elems, cost, 2.6, [0, 1, 2])[0] == {0: (2, 4), 1: (2, 2), 2: (2, 2)}
    assert allocate(err, elems, cost, 2.7, [0, 1, 2])[0] == {0: (4, 4), 1: (2, 2), 2: (2, 2)}
    assert allocate(err, elems, cost, 9.0, [0, 1, 2])[0] == {i: (8, 8) for i in range(3)}


def test_allocate_is_exact_where_a_greedy_ratio_pick_is_not():
    # 0.5 spare bits: layer 0's K gains 1.0 for 0.1 bit (the best ratio), layer 1's K 4.0 for 0.5. Taking the
    # ratio first leaves 0.4, too little for layer 1 (gain 1.0); the optimum spends all 0.5 on layer 1 (gain 4.0).
    elems = {0: (100, 0), 1: (500, 0), 2: (0, 1400)}
    cost = {(i, b): (b + 0.5, b + 0.5) for i in range(3) for b in (2, 4, 8)}
    err = {(i, t, b): 0.0 for i in range(3) for t in (0, 1) for b in (2, 4, 8)}
    err.update({(0, 0, 2): 1.0, (1, 0, 2): 4.0, (2, 1, 2): 0.5, (2, 1, 4): 0.4, (2, 1, 8): 0.39})
    assign, pred, held = allocate(err, elems, cost, 3.0, [0, 1, 2])
    assert assign == {0: (2, 2), 1: (4, 2), 2: (2, 2)} and pred == pytest.approx(1.5) and held == pytest.approx(3.0)
    # brute force over every assignment agrees on random instances (the knapsack's rounding aside)
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(20):
        elems = {i: (rng.randint(1, 900), rng.randint(1, 900)) for i in range(3)}
        err = {(i, t, b): e for i in range(3) for t in (0, 1)
               for b, e in zip((2, 4, 8), sorted((rng.random() for _ in range(3)), reverse=True))}
        budget = rng.uniform(2.6, 6.0)
        total = sum(sum(e) for e in elems.values())
        best = min((sum(err[(i, t, c[2 * i + t])] for i in range(3) for t in (0, 1)), c)
                   for c in itertools.product((2, 4, 8), repeat=6)
                   if sum(elems[i][t] * (c[2 * i + t] + 0.5) for i in range(3) for t in (0, 1)) / total <= budget - 6e-4)
        assign, pred, held = allocate(err, elems, cost, budget, [0, 1, 2])
        assert held <= budget + 1e-9 and pred <= best[0] + 1e-12, (budget, assign, best)


@pytest.fixture
def no_model_work(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(lowbit.models, "load", refuse)
    monkeypatch.setattr(lowbit.models, "resolve", refuse)
    monkeypatch.setattr(lowbit.runtime.load, "resolve", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--budget", "2.4"], "--budget 2.4 is below the smallest recipe's held bits (2.500 b/elt at 8192 tokens"),
    (["--budget", "2.5", "--context", "9000"], "--context 9000 is longer than the context of smollm2-135m (8192"),
    (["--budget", "0"], "--budget must be positive numbers"),
    (["--budget", "3", "--grids", "uniform"], "--grids uniform: use a comma list of std, lloyd-max"),
    (["--budget", "3", "--seq-len", "100"], "--seq-len 100 is shorter than sink 64 + recent 256 + page 16"),
    (["--budget", "3", "--rotations", "spin"], "--rotations spin: not none, hadamard or a RotationSet directory"),
])
def test_bad_tune_input_refused_before_model_work(argv, message, no_model_work, capsys, tmp_path):
    rc = main(["tune", "--model", "smollm2-135m", "--out", str(tmp_path / "r.toml"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_a_short_context_has_no_budget(no_model_work, capsys, tmp_path):
    assert main(["tune", "--model", "smollm2-135m", "--budget", "3", "--context", "300",
                 "--out", str(tmp_path / "r.toml")]) == 2
    assert "every token sits in the sink + recent tiers" in capsys.readouterr().err


def test_tune_writes_a_recipe_within_budget_that_eval_runs(tiny_dir, corpus, tmp_path, capsys):
    out = tmp_path / "tiny@3.1.toml"
    rc = main(["tune", "--model", str(tiny_dir), "--budget", "3.1", "--context", "4000", "--sink", "16",
               "--recent", "32", "--seq-len", "99", "--windows", "1", "--data", str(corpus), "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    s = load_recipe(out)
    geo = ModelGeometry.from_config(json.loads((tiny_dir / "config.json").read_text()), name=tiny_dir.name)
    h = held_bits(s, 4000, geometry=geo)
    # 0.6 spare bits over int2's 2.5: one tensor (1/4 of the elements) went up
    assert h.bits <= 3.1 + 1e-9 and s.layer_bits
    import tomllib

    doc = tomllib.loads(out.read_text())["tune"]
    assert doc["budget"] == 3.1 and doc["context"] == 4000 and doc["held_bits"] == pytest.approx(h.bits, abs=1e-6)
    assert doc["calib_data"] == str(corpus) and len(tomllib.loads(out.read_text())["tune"]["candidates"]) == 2
    assert main(["tune", "--model", str(tiny_dir), "--budget", "3.1", "--out", str(out)]) == 2  # never overwritten
    rc = main(["eval", "--model", str(tiny_dir), "--data", str(corpus), "--seq-len", "120", "--windows", "1",
               "--chunk", "40", "--dtype", "fp32", "--recipe", str(out), "--no-progress", "--no-full-window",
               "--json", str(tmp_path / "e.json")])
    assert rc == 0, capsys.readouterr().err
    rows = {r["scheme"]: r for r in json.loads((tmp_path / "e.json").read_text())["results"]}
    assert rows["tiny@3.1"]["quantized_rows"] > 0
    # a recipe tuned for one model is refused on another
    with pytest.raises(LowbitError, match="was tuned for"):
        plan_schemes("bf16", {}, recipe=str(out), model="smollm2-135m")


def test_shipped_recipes_by_name_are_pinned(tmp_path, monkeypatch):
    d = tmp_path / "recipes"
    d.mkdir()
    text = '[kv]\nscheme = "int2"\nrotation = "hadamard"\n[kv.layer_bits]\n"3" = "k4v2"\n[tune]\nmodel = "smollm2-135m"\n'
    (d / "smollm2-135m@2.7.toml").write_text(text)
    sha = hashlib.sha256(text.encode()).hexdigest()
    (d / "index.json").write_text(json.dumps({"smollm2-135m@2.7": {"file": "smollm2-135m@2.7.toml", "sha256": sha}}))
    monkeypatch.setattr(lowbit.recipes, "RECIPES_DIR", d)
    assert load_recipe("smollm2-135m@2.7").layer_bits == ((3, "k4v2"),)
    rows = plan_schemes("bf16,smollm2-135m@2.7", {}, model="smollm2-135m")
    assert [r.label for r in rows] == ["bf16", "smollm2-135m@2.7"]
    assert plan_schemes("bf16", {}, recipe="smollm2-135m@2.7")[1].label == "smollm2-135m@2.7"
    with pytest.raises(LowbitError, match="tuned for smollm2-135m, not gemma3-270m"):
        plan_schemes("bf16", {}, recipe="smollm2-135m@2.7", model="gemma3-270m")
    with pytest.raises(LowbitError, match="no shipped recipe 'smollm2-135m@9'; shipped: smollm2-135m@2.7"):
        load_recipe("smollm2-135m@9")
    (d / "smollm2-135m@2.7.toml").write_text(text + "# edited\n")
    with pytest.raises(LowbitError, match="it was modified: reinstall lowbit"):
        load_recipe("smollm2-135m@2.7")


def test_the_shipped_index_matches_its_files():
    from lowbit.kv.scheme import RotationRef

    idx = lowbit.recipes.index()
    for name, e in idx.items():
        p = lowbit.recipes.RECIPES_DIR / e["file"]
        assert hashlib.sha256(p.read_bytes()).hexdigest() == e["sha256"], name
        s = load_recipe(name)
        assert s.quantized
        if isinstance(s.rotation, RotationRef):  # a shipped key affine or rotation set: inside the package, pinned
            d = Path(s.rotation.path)
            f = d / ("key_affine.safetensors" if (d / "key_affine.safetensors").is_file() else "rotations.safetensors")
            assert f.is_file() and lowbit.recipes.RECIPES_DIR in f.parents, name
            assert hashlib.sha256(f.read_bytes()).hexdigest() == s.rotation.sha256, name
        if s.levels is not None:  # fitted codebooks (VQ rows): inside the package, pinned
            f = Path(s.levels.path) / "levels.safetensors"
            assert f.is_file() and lowbit.recipes.RECIPES_DIR in f.parents, name
            assert hashlib.sha256(f.read_bytes()).hexdigest() == s.levels.sha256, name
    assert "qwen2.5-coder-1.5b@2.5" in idx
    assert (lowbit.recipes.RECIPES_DIR / "rotations" / "smollm2-135m_per-head" / "rotations.safetensors").is_file()


def test_tune_measures_a_key_affine_candidate_with_its_maps_and_pins_it(tiny_dir, corpus, tmp_path, capsys):
    """A key-affine artifact among --rotations: its K-only errors are measured on mapped keys (they differ
    from plain Hadamard's), its V-only errors equal Hadamard's (V is not mapped), and a recipe that picks it
    names it as {path relative to the recipe, sha256} so `lowbit eval --recipe` opens the same fit."""
    import tomllib

    from lowbit.artifacts import load_manifest
    from lowbit.calib import key_affine as kfit
    from lowbit.calib.corpora import load_text, token_windows
    from lowbit.kv import key_affine as kam
    from lowbit.runtime.load import resolve

    lm = resolve(str(tiny_dir))
    windows = token_windows(lm.tokenizer, load_text(str(corpus)), 77, 2)
    maps = kfit.fit(lm.model, windows, skip=8)
    ka_dir = kam.save(tmp_path / "art" / "ka", maps, model=lm.geometry.name)
    sha = load_manifest(ka_dir).file_map()[kam.FILE_NAME].sha256
    out = tmp_path / "recipes" / "tiny@2.7.toml"
    rc = main(["tune", "--model", str(tiny_dir), "--budget", "2.7", "--context", "4000", "--sink", "16",
               "--recent", "32", "--seq-len", "99", "--windows", "1", "--data", str(corpus), "--grids", "std",
               "--rotations", f"hadamard,{ka_dir}", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = tomllib.loads(out.read_text())
    db = doc["tune"]["layer_error_db"]
    ka = str(ka_dir)
    assert db[f"{ka}|K2|std"] != db["hadamard|K2|std"] and db[f"{ka}|K4|minmax"] != db["hadamard|K4|minmax"]
    assert db[f"{ka}|V2|std"] == db["hadamard|V2|std"]
    assert {c["rotation"] for c in doc["tune"]["candidates"]} == {"hadamard", ka}
    # whichever won, the written rotation loads; a key-affine win is pinned and relative to the recipe
    s = load_recipe(out)
    if doc["tune"]["rotation"] == ka:
        assert doc["kv"]["rotation"] == {"path": "../art/ka", "sha256": sha}
        assert s.rotation.path == str(ka_dir.resolve()) and s.rotation.sha256 == sha
    else:
        assert s.rotation == "hadamard"
    # the candidate table says what each rotation's calibration PPL was; a forced key-affine recipe runs in eval
    forced = tmp_path / "recipes" / "forced.toml"
    forced.write_text(f'[kv]\nscheme = "int2"\nsink = 16\nrecent = 32\nrotation = {{ path = "../art/ka", '
                      f'sha256 = "{sha}" }}\n')
    rc = main(["eval", "--model", str(tiny_dir), "--data", str(corpus), "--seq-len", "120", "--windows", "1",
               "--chunk", "40", "--dtype", "fp32", "--recipe", str(forced), "--no-progress", "--no-full-window",
               "--json", str(tmp_path / "e.json")])
    assert rc == 0, capsys.readouterr().err
    rows = {r["scheme"]: r for r in json.loads((tmp_path / "e.json").read_text())["results"]}
    assert rows["forced"]["quantized_rows"] > 0


def test_tune_scale_only_grid_buys_a_4bit_tensor_the_std_grid_cannot(tiny_dir, corpus, tmp_path, capsys):
    """--grids std,scale-only at 2.75 b/elt on a head_dim-64 model (2 layers: 4 tensors of 1/4 the elements):
    int2 with a zero is 2.5, one int4 tensor on top 3.0 (over); scale-only int2 is 2.25 and one 4.25-bit
    tensor brings it to exactly 2.75. The recipe names zero = "none", loads, and holds what it says."""
    import tomllib

    out = tmp_path / "tiny@2.75.toml"
    rc = main(["tune", "--model", str(tiny_dir), "--budget", "2.75", "--context", "4000", "--sink", "16",
               "--recent", "32", "--seq-len", "99", "--windows", "1", "--data", str(corpus),
               "--grids", "std,scale-only", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = tomllib.loads(out.read_text())
    cands = {c["grid_2bit"]: c for c in doc["tune"]["candidates"]}
    assert cands["std"]["layers_above_2bit"] == 0 and cands["scale-only"]["layers_above_2bit"] == 1
    assert cands["scale-only"]["held_bits"] == pytest.approx(2.75, abs=1e-3)
    assert "hadamard|K4|scale-only" in doc["tune"]["layer_error_db"]
    if doc["tune"]["grid_2bit"] == "scale-only":
        s = load_recipe(out)
        assert s.k.zero == "none" and doc["kv"]["zero"] == "none"
        geo = ModelGeometry.from_config(json.loads((tiny_dir / "config.json").read_text()), name=tiny_dir.name)
        assert held_bits(s, 4000, geometry=geo).bits == pytest.approx(doc["tune"]["held_bits"], abs=1e-6)
        (i, name), = s.layer_bits
        assert s.for_layer(i).k.zero == s.for_layer(i).v.zero == "none" and "4" in name


def test_tune_offers_one_byte_scales_and_writes_them(tiny_dir, corpus, tmp_path, capsys):
    """--grids scale-only-mse,scale-only-mse-ue5m3 at 2.7 b/elt (head_dim 64, 2 layers: 4 tensors of 1/4 the
    elements): fp16 scale-only int2 holds 2.25 and one int4 tensor would make it 2.75 (over); with one-byte
    scales int2 holds 2.125 and one 4.125-bit tensor brings it to 2.625. The recipe names the format."""
    import tomllib

    out = tmp_path / "tiny@2.7.toml"
    rc = main(["tune", "--model", str(tiny_dir), "--budget", "2.7", "--context", "4000", "--sink", "16",
               "--recent", "32", "--seq-len", "99", "--windows", "1", "--data", str(corpus),
               "--grids", "scale-only-mse,scale-only-mse-ue5m3", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = tomllib.loads(out.read_text())
    cands = {c["grid_2bit"]: c for c in doc["tune"]["candidates"]}
    assert cands["scale-only-mse"]["layers_above_2bit"] == 0
    assert cands["scale-only-mse-ue5m3"]["layers_above_2bit"] == 1
    assert cands["scale-only-mse-ue5m3"]["held_bits"] == pytest.approx(2.625, abs=1e-3)
    assert "hadamard|K2|scale-only-mse-ue5m3" in doc["tune"]["layer_error_db"]
    s = load_recipe(out)
    if doc["tune"]["grid_2bit"] == "scale-only-mse-ue5m3":
        assert doc["kv"]["scale_format"] == "ue5m3" and s.k.scale_format == s.v.scale_format == "ue5m3"
        (i, _name), = s.layer_bits
        assert s.for_layer(i).k.scale_format == "ue5m3"
    else:
        assert "scale_format" not in doc["kv"] and s.k.scale_format == "fp16"
    geo = ModelGeometry.from_config(json.loads((tiny_dir / "config.json").read_text()), name=tiny_dir.name)
    assert held_bits(s, 4000, geometry=geo).bits == pytest.approx(doc["tune"]["held_bits"], abs=1e-6)


def test_tune_vq_grid_with_codebooks_writes_a_pinned_recipe_that_eval_runs(tiny_dir, corpus, tmp_path, capsys):
    """--grids scale-only-mse-ue5m3,vq --codebooks DIR (fitted by `lowbit calibrate --vq-for` an all-VQ recipe):
    the vq base holds the codebooks in its held bits; the written recipe names the codebooks by {path, sha256}
    relative to itself, loads, holds what it says and runs in eval. Bad input: vq without --codebooks."""
    import tomllib

    allvq = tmp_path / "allvq.toml"
    allvq.write_text('[kv]\nscheme = "int2"\nsink = 16\nrecent = 32\nzero = "none"\nscale_format = "ue5m3"\n'
                     'vq = "2x16,4x256"\n')
    cb = tmp_path / "cb"
    assert main(["calibrate", "--model", str(tiny_dir), "--data", str(corpus), "--tokens", "2560", "--seq-len", "128",
                 "--skip", "8", "--dtype", "fp32", "--no-progress", "--vq-for", str(allvq), "--out", str(cb)]) == 0
    capsys.readouterr()
    base = ["tune", "--model", str(tiny_dir), "--budget", "2.9", "--context", "4000", "--sink", "16", "--recent", "32",
            "--seq-len", "99", "--windows", "1", "--data", str(corpus)]
    assert main(base + ["--grids", "vq", "--out", str(tmp_path / "x.toml")]) == 2
    assert "--codebooks" in capsys.readouterr().err
    out = tmp_path / "recipes" / "tiny@2.9.toml"
    rc = main(base + ["--grids", "scale-only-mse-ue5m3,vq", "--codebooks", str(cb), "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = tomllib.loads(out.read_text())
    cands = {c["grid_2bit"]: c for c in doc["tune"]["candidates"]}
    geo = ModelGeometry.from_config(json.loads((tiny_dir / "config.json").read_text()), name=tiny_dir.name)
    assert cands["vq"]["held_bits"] <= 2.9 + 1e-9
    assert "hadamard|K2|vq" in doc["tune"]["layer_error_db"] and "hadamard|V2|vq" in doc["tune"]["layer_error_db"]
    if doc["tune"]["grid_2bit"] == "vq":
        s = load_recipe(out)
        assert s.k.vq == "2x16" and s.v.vq == "4x256" and s.levels.sha256 is not None
        assert doc["kv"]["levels"]["path"] == "../cb"  # relative to the recipe
        assert held_bits(s, 4000, geometry=geo).bits == pytest.approx(doc["tune"]["held_bits"], abs=1e-6)
        rc = main(["eval", "--model", str(tiny_dir), "--data", str(corpus), "--seq-len", "120", "--windows", "1",
                   "--chunk", "40", "--dtype", "fp32", "--recipe", str(out), "--no-progress", "--no-full-window",
                   "--json", str(tmp_path / "e.json")])
        assert rc == 0, capsys.readouterr().err
        rows = json.loads((tmp_path / "e.json").read_text())["results"]
        assert rows[-1]["status"] == "ok" and rows[-1]["quantized_rows"] > 0
