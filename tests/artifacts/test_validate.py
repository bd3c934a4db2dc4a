"""`lowbit validate`: the three artifact kinds pass all four stages; a flipped byte, a fake-quant-eval artifact,
a wrong base and a tight accuracy bar each fail the stage they belong to; bad input writes nothing."""

from __future__ import annotations

import json
import shutil

import pytest

from lowbit.cli import main


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """A tiny smollm2-geometry model dir (9 q / 3 kv heads, D 64, byte tokenizer) and its three artifacts:
    a k4v2 vLLM export, a w8a16 checkpoint, a per-KV-head rotation set."""
    import torch

    from lowbit.rotation.rotation_set import RotationSet
    from tests.serve.conftest import tiny_runtime

    root = tmp_path_factory.mktemp("validate")
    d = root / "tiny-smollm2"
    rt = tiny_runtime("bf16")
    rt.model.save_pretrained(d)
    rt.tokenizer.save_pretrained(d)
    assert main(["export", "--for", "vllm", "--model", str(d), "--kv", "k4v2", "--out", str(root / "exp")]) == 0
    assert main(["quantize", "--model", str(d), "--weights", "w8a16", "--method", "rtn", "--out", str(root / "ckpt")]) == 0
    g = torch.Generator().manual_seed(0)

    def ortho(h):  # [H, 64, 64] random orthogonal
        return torch.stack([torch.linalg.qr(torch.randn(64, 64, generator=g))[0] for _ in range(h)])

    RotationSet(model=d.name, k=(ortho(3), ortho(3)), v=(ortho(3), ortho(3))).save(root / "rot")
    return root


def _run(capsys, *argv):
    rc = main(["validate", *map(str, argv)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _stages(report):
    return [(r["stage"], r["ok"]) for r in report["stages"]]


def test_kv_export_passes_every_stage_and_the_json_carries_provenance(arts, tmp_path, capsys):
    out = tmp_path / "v.json"
    rc, text, err = _run(capsys, arts / "exp", "--device", "cpu", "--json", out)
    print(text)
    assert rc == 0, text + err
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["kind"] == "kv-export" and _stages(rep) == [(1, True), (2, True), (3, True), (4, True)]
    for r in rep["stages"]:
        assert set(r) >= {"stage", "name", "ok", "checks", "error", "seconds"} and r["error"] is None
    s2 = {c["name"]: c for c in rep["stages"][1]["checks"]}
    # the audit ran the kernel at the artifact's shapes: k4v2, D 64, group 64, GQA 9/3, with dense tiers
    assert any(n.startswith("decode_attention B3 Hq9/Hkv3 D64 T37 k4v2 g64 +tiers") for n in s2)
    s3 = {c["name"]: c for c in rep["stages"][2]["checks"]}
    assert s3["packed tier"]["ok"] and "rows encoded" in s3["packed tier"]["detail"]
    m = rep["stages"][3]["metrics"]
    assert m["scored"] == 511 and m["mean_kl"] > 0 and abs(m["dppl_pct"]) < 50  # k4v2 really quantized something
    p = rep["provenance"]
    assert p["lowbit"]["version"] and "commit" in p["lowbit"] and "modified" in p["lowbit"]
    if p["lowbit"]["commit"] is not None:  # running from a checkout
        assert len(p["lowbit"]["commit"]) == 40 and isinstance(p["lowbit"]["modified"], bool)
    assert set(p["packages"]) >= {"torch", "transformers", "triton", "compressed-tensors", "safetensors", "python"}
    assert p["device"]["type"] == "cpu"
    files = {f["path"]: f["sha256"] for f in p["artifact"]["files"]}
    assert {"model.safetensors", "lowbit_kv.json", "config.json"} <= set(files) and len(p["artifact"]["manifest_sha256"]) == 64
    kvplan = p["plan"]["kv"]
    assert kvplan["scheme"]["k"]["bits"] == 4 and kvplan["scheme"]["v"]["bits"] == 2 and len(kvplan["layers"]) == 2
    assert kvplan["layers"][0]["backends"]["decode"]["name"] == "torch-stream"
    assert p["flags"]["device"] == "cpu" and p["flags"]["stages"] == [1, 2, 3, 4]
    assert "stages 1,2,3,4 passed" in text


def test_weights_checkpoint_passes_every_stage_against_its_base(arts, capsys):
    rc, text, _ = _run(capsys, arts / "ckpt", "--base", arts / "tiny-smollm2", "--device", "cpu")
    print(text)
    assert rc == 0, text
    assert "no weight kernel is used by this artifact on this device" in text and "twin only" in text
    assert "w8a16: 14 quantized linears" in text and "stages 1,2,3,4 passed" in text


def test_rotation_set_passes_every_stage_on_its_model(arts, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the manifest names 'tiny-smollm2', which does not resolve here
    rc, text, _ = _run(capsys, arts / "rot", "--device", "cpu")
    assert rc == 1 and "pass --model NAME_OR_DIR" in text and "stage 2 kernel-audit  skipped" in text
    out = tmp_path / "r.json"
    rc, text, _ = _run(capsys, arts / "rot", "--model", arts / "tiny-smollm2", "--kv", "k4v2", "--json", out)
    print(text)
    assert rc == 0, text
    rep = json.loads(out.read_text())
    assert _stages(rep) == [(1, True), (2, True), (3, True), (4, True)] and rep["kind"] == "rotations"
    # the cache really used the fitted rotations, pinned by their sha256
    assert rep["provenance"]["plan"]["kv"]["rotation_sha256"] == next(
        f["sha256"] for f in rep["provenance"]["artifact"]["files"] if f["path"] == "rotations.safetensors")
    assert "k4v2 g64" in text


def test_one_flipped_byte_fails_stage_1_and_names_the_file(arts, tmp_path, capsys):
    bad = tmp_path / "exp"
    shutil.copytree(arts / "exp", bad)
    f = bad / "model.safetensors"
    b = bytearray(f.read_bytes())
    b[len(b) // 2 + 1] ^= 0x01
    f.write_bytes(bytes(b))
    out = tmp_path / "v.json"
    rc, text, _ = _run(capsys, bad, "--json", out)
    assert rc == 1
    rep = json.loads(out.read_text())  # a failed validation is still a complete report
    assert rep["failed_stage"] == 1 and _stages(rep) == [(1, False)]
    assert "model.safetensors FAILED" in rep["error"] and "stage 1 (cpu-checks)" in rep["error"]
    assert [s["stage"] for s in rep["skipped"]] == [2, 3, 4]
    assert "FAILED at stage 1 (cpu-checks): digests: model.safetensors FAILED" in text


def test_fake_quant_eval_artifact_is_refused_where_native_packed_is_needed(arts, tmp_path, capsys):
    from lowbit.artifacts import ArtifactWriter

    fq = tmp_path / "layer-error"
    with ArtifactWriter(fq, kind="layer-error", artifact_class="fake-quant-eval", inputs={"model": "tiny"},
                        recipe={}) as w:
        (w.path / "db.json").write_text("{}")
    rc, text, _ = _run(capsys, fq)
    assert rc == 1
    assert "is class 'fake-quant-eval' (kind 'layer-error') but 'native-packed' is required" in text
    # the line says what the class means and where the README defines the classes (it never did)
    assert "(packed low-bit codes + scales, as `lowbit quantize` and `lowbit export` write; README: Checking" in text
    # an export relabelled fake-quant-eval (its files intact) is refused the same way, by class
    relabel = tmp_path / "exp"
    shutil.copytree(arts / "exp", relabel)
    m = json.loads((relabel / "manifest.json").read_text())
    m["class"] = "fake-quant-eval"
    m.pop("self_sha256")  # a deliberate hand edit drops the seal (a sealed manifest refuses any change)
    (relabel / "manifest.json").write_text(json.dumps(m))
    rc, text, _ = _run(capsys, relabel, "--stages", "1,2")
    assert rc == 1 and "digests: all 7 files match" in text
    assert "'fake-quant-eval' (kind 'vllm-model') but 'native-packed' is required" in text


def test_a_wrong_base_fails_stage_3_not_stage_1(arts, tmp_path, capsys):
    """Another random model of the same geometry passes the CPU checks (its config fits) but is not the
    model the checkpoint was quantized from: the weights sha256 says so when it is loaded."""
    from tests.serve.conftest import tiny_runtime

    other = tmp_path / "other"
    rt = tiny_runtime("bf16", seed=1)
    rt.model.save_pretrained(other)
    rt.tokenizer.save_pretrained(other)
    rc, text, _ = _run(capsys, arts / "ckpt", "--base", other, "--stages", "1,3")
    assert rc == 1
    assert "stage 1 cpu-checks    ok" in text and "stage 2 kernel-audit  skipped (not asked)" in text
    assert "FAILED at stage 3 (smoke)" in text and "pass the model it was made from (--base)" in text


def test_accuracy_bar_is_real(arts, capsys):
    rc, text, _ = _run(capsys, arts / "exp", "--stages", "1,4", "--max-kl", "1e-6")
    assert rc == 1 and "FAILED at stage 4 (accuracy): kl: mean KL(reference || artifact)" in text
    assert "stage 3 smoke         skipped (not asked)" in text


@pytest.mark.parametrize("argv,msg", [
    (["--stages", "2,3"], "stage 1 (the CPU checks) is what later stages build on"),
    (["--stages", "1,5"], "stages are 1 (cpu-checks)"),
    (["--model", "x"], "--model is for rotations artifacts but"),
])
def test_bad_flags_are_one_line_errors(arts, capsys, argv, msg):
    rc, _, err = _run(capsys, arts / "exp", *argv)
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1


def test_no_manifest_is_a_one_line_error_and_writes_nothing(tmp_path, capsys):
    d = tmp_path / "plain"
    d.mkdir()
    (d / "config.json").write_text("{}")
    out = tmp_path / "v.json"
    rc, _, err = _run(capsys, d, "--json", out)
    assert rc == 2 and not out.exists() and not list(tmp_path.glob(".v.json*"))
    assert err.strip().splitlines() == [err.strip()] and "has no manifest.json" in err and "lowbit pin" in err


def test_existing_json_is_refused_before_any_stage(arts, tmp_path, capsys):
    out = tmp_path / "v.json"
    out.write_text("keep")
    rc, text, err = _run(capsys, arts / "exp", "--json", out)
    assert rc == 2 and "already exists" in err and out.read_text() == "keep" and text == ""


def test_kernel_cases_follow_the_plan():
    """Only shapes the kernel takes are audited, each once; per-channel K (KIVI) is named as torch-only."""
    from lowbit.kv.plan import resolve
    from lowbit.models.geometry import ModelGeometry
    from lowbit.models.tiny import tiny_config
    from lowbit.tools.validate import kernel_cases

    gemma = ModelGeometry.from_config(tiny_config("gemma3-270m", num_layers=7))
    cases, notes = kernel_cases(resolve("int2", gemma), "cpu")
    assert [n for n, _ in cases] == ["B3 Hq4/Hkv1 D256 T37 k2v2 g128 +tiers ragged"]  # D/2 groups, MQA, 7 layers once
    assert notes[-1].startswith("layers 0,1,2,3,4,5,6: k2v2 D256 g128")
    cases, notes = kernel_cases(resolve("int2", gemma), "cuda")
    assert [kw["T"] for _, kw in cases] == [8192, 32768] and cases[0][1]["sink"] == 64
    smol = ModelGeometry.from_config(tiny_config("smollm2-135m", num_layers=3))
    cases, notes = kernel_cases(resolve("kivi2", smol), "cpu")
    assert cases == [] and len(notes) == 3 and "grouped per channel" in notes[0]


def test_cpu_audit_runs_in_an_interpreter_child_when_this_process_has_none(monkeypatch):
    """The CLI on CPU has no TRITON_INTERPRET: the audit then runs in a child process that has it."""
    from lowbit.tools.validate import _audit_rows

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rows = _audit_rows([("t", {"B": 2, "Hq": 3, "Hkv": 1, "D": 64, "T": 9, "kbits": 2, "vbits": 4, "group": 32,
                               "sink": 2, "recent": 3, "ragged": True})], "cpu")
    assert len(rows) == 1 and rows[0]["ok"] and rows[0]["finite"] and rows[0]["rel_l2"] < 1e-3


def test_export_with_quantized_weights_is_checked_against_its_base(arts, tmp_path, capsys):
    """`export --weights CKPT`: the KV plan and the checkpoint's tensors in stage 1, the unquantized model the
    export names (inputs.model_dir) as the reference of stages 3-4."""
    out = tmp_path / "expw"
    assert main(["export", "--for", "vllm", "--model", str(arts / "tiny-smollm2"), "--kv", "int4", "--weights",
                 str(arts / "ckpt"), "--out", str(out)]) == 0
    capsys.readouterr()
    rc, text, _ = _run(capsys, out, "--device", "cpu")
    print(text)
    assert rc == 0, text
    assert "w8a16: 14 quantized linears" in text and f"reference {arts / 'tiny-smollm2'}" in text
    assert "no weight kernel is used by this artifact on this device" in text and "k4v4 D64 g64" in text


@pytest.mark.slow
def test_real_smollm2_int2_export_passes_every_stage(tmp_path, capsys):
    """The built-in model (its GGUF converted once into ~/.cache/lowbit): default int2 export, four stages on CPU."""
    out = tmp_path / "exp"
    assert main(["export", "--for", "vllm", "--model", "smollm2-135m", "--kv", "int2", "--out", str(out)]) == 0
    capsys.readouterr()
    rep_path = tmp_path / "v.json"
    rc, text, _ = _run(capsys, out, "--device", "cpu", "--json", rep_path)
    print(text)
    assert rc == 0, text
    m = json.loads(rep_path.read_text())["stages"][3]["metrics"]
    assert 0 < m["mean_kl"] < 0.5 and m["scored"] == 511
