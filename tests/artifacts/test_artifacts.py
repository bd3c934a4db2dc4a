import hashlib
import json
import os

import pytest

from lowbit.artifacts import (
    FAILED,
    MANIFEST_NAME,
    MISSING,
    OK,
    UNLISTED,
    ArtifactWriter,
    all_ok,
    load_manifest,
    pin,
    require_class,
    sha256_file,
    verify,
)
from lowbit.core.errors import LowbitError


def make_files(root):
    """Three files, one nested two deep, one empty, one spanning more than one 1 MiB hashing chunk."""
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"hello\n")
    (root / "sub" / "deeper" / "empty.bin").write_bytes(b"")
    (root / "sub" / "big.bin").write_bytes(bytes(range(256)) * 4099 + b"x")  # 1 MiB + 3 KiB + 1 byte
    return ["a.txt", "sub/big.bin", "sub/deeper/empty.bin"]


def write_artifact(out, **kw):
    args = {"kind": "kv-eval", "artifact_class": "fake-quant-eval", "inputs": {"model": "m"}, "recipe": {"k_bits": 2}}
    args.update(kw)
    with ArtifactWriter(out, **args) as w:
        make_files(w.path)
        w.counts = {"layers": 3, "quantized_modules": 6, "skipped": 1}
    return w


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name)


def test_sha256_file_matches_hashlib_across_chunks(tmp_path):
    make_files(tmp_path)
    for rel in ("a.txt", "sub/big.bin", "sub/deeper/empty.bin"):
        data = (tmp_path / rel).read_bytes()
        assert sha256_file(tmp_path / rel) == hashlib.sha256(data).hexdigest()


def test_writer_writes_complete_manifest_atomically(tmp_path):
    out = tmp_path / "runs" / "art1"  # parent created on demand
    w = write_artifact(out, inputs={"model": "smollm2-135m", "weights_sha256": "ab" * 32})
    assert out.is_dir() and leftovers(out.parent) == []
    m = load_manifest(out)
    assert m == w.manifest and m.root == out
    assert (m.kind, m.artifact_class, m.format_version) == ("kv-eval", "fake-quant-eval", 1)
    assert m.inputs == {"model": "smollm2-135m", "weights_sha256": "ab" * 32}
    assert m.recipe == {"k_bits": 2}
    assert m.counts == {"layers": 3, "quantized_modules": 6, "skipped": 1}
    assert set(m.versions) >= {"lowbit", "torch", "transformers"} and m.versions["torch"]
    assert [e.path for e in m.files] == ["a.txt", "sub/big.bin", "sub/deeper/empty.bin"]
    for e in m.files:
        assert e.bytes == (out / e.path).stat().st_size
        assert e.sha256 == hashlib.sha256((out / e.path).read_bytes()).hexdigest()
    raw = json.loads((out / MANIFEST_NAME).read_text())
    assert raw["class"] == "fake-quant-eval" and raw["format_version"] == 1
    assert all_ok(verify(out))


def test_writer_inputs_and_recipe_settable_inside_block(tmp_path):
    with ArtifactWriter(tmp_path / "o", kind="k", artifact_class="native-packed", inputs={}, recipe={}) as w:
        (w.path / "x").write_bytes(b"1")
        w.inputs = {"model": "late"}
        w.recipe = {"w_bits": 4}
    m = load_manifest(tmp_path / "o")
    assert m.inputs == {"model": "late"} and m.recipe == {"w_bits": 4}


def test_writer_exception_leaves_nothing_and_propagates(tmp_path):
    out = tmp_path / "o"
    with (
        pytest.raises(RuntimeError, match="boom"),
        ArtifactWriter(out, kind="k", artifact_class="generic", inputs={}, recipe={}) as w,
    ):
        make_files(w.path)
        staging = w.path
        assert staging.is_dir() and staging.parent == tmp_path and staging.name.startswith(".o.tmp-")
        raise RuntimeError("boom")
    assert not out.exists() and not staging.exists()
    assert list(tmp_path.iterdir()) == []


def test_writer_bad_counts_fail_at_finish_and_clean_up(tmp_path):
    with (
        pytest.raises(LowbitError, match="plain JSON"),
        ArtifactWriter(tmp_path / "o", kind="k", artifact_class="generic", inputs={}, recipe={}) as w,
    ):
        (w.path / "x").write_bytes(b"1")
        w.counts = {"ppl": float("nan")}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("existing", ["empty_dir", "full_dir", "file"])
def test_writer_refuses_existing_out_dir(tmp_path, existing):
    out = tmp_path / "o"
    if existing == "file":
        out.write_bytes(b"keep")
    else:
        out.mkdir()
        if existing == "full_dir":
            (out / "keep").write_bytes(b"keep")
    with (
        pytest.raises(LowbitError, match="already exists.*never overwritten"),
        ArtifactWriter(out, kind="k", artifact_class="generic", inputs={}, recipe={}),
    ):
        pass
    assert leftovers(tmp_path) == []
    if existing == "full_dir":
        assert (out / "keep").read_bytes() == b"keep"


def test_writer_refuses_out_dir_that_appears_during_write(tmp_path):
    # os.rename would silently replace an empty directory: the writer must check right before it.
    out = tmp_path / "o"
    with (
        pytest.raises(LowbitError, match="already exists"),
        ArtifactWriter(out, kind="k", artifact_class="generic", inputs={}, recipe={}) as w,
    ):
        (w.path / "x").write_bytes(b"1")
        out.mkdir()
    assert list(out.iterdir()) == [] and leftovers(tmp_path) == []


def test_writer_refuses_symlinks_and_own_manifest(tmp_path):
    (tmp_path / "outside").write_bytes(b"x")
    with (
        pytest.raises(LowbitError, match="symlinks"),
        ArtifactWriter(tmp_path / "o", kind="k", artifact_class="generic", inputs={}, recipe={}) as w,
    ):
        os.symlink(tmp_path / "outside", w.path / "link")
    with (
        pytest.raises(LowbitError, match="written by ArtifactWriter itself"),
        ArtifactWriter(tmp_path / "p", kind="k", artifact_class="generic", inputs={}, recipe={}) as w,
    ):
        (w.path / MANIFEST_NAME).write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside"]


def test_writer_argument_errors(tmp_path):
    with pytest.raises(LowbitError, match="unknown artifact class 'fake-quant'"):
        ArtifactWriter(tmp_path / "o", kind="k", artifact_class="fake-quant", inputs={}, recipe={})
    with pytest.raises(LowbitError, match="kind"):
        ArtifactWriter(tmp_path / "o", kind="", artifact_class="generic", inputs={}, recipe={})
    with pytest.raises(LowbitError, match="recipe must be a dict"):
        ArtifactWriter(tmp_path / "o", kind="k", artifact_class="generic", inputs={}, recipe=[1])
    w = ArtifactWriter(tmp_path / "o", kind="k", artifact_class="generic", inputs={}, recipe={})
    with pytest.raises(LowbitError, match="inside"):
        _ = w.path


def test_require_class(tmp_path):
    write_artifact(tmp_path / "fq")
    m = load_manifest(tmp_path / "fq")
    assert require_class(m, "fake-quant-eval") is m
    with pytest.raises(LowbitError, match=r"class 'fake-quant-eval'.*'native-packed' is required.*not interchangeable"):
        require_class(m, "native-packed")
    with pytest.raises(LowbitError, match="unknown artifact class"):
        require_class(m, "native")


def test_pin_then_verify_ok(tmp_path):
    names = make_files(tmp_path)
    m = pin(tmp_path, "rotation-set", "generic")
    assert [e.path for e in m.files] == names
    assert leftovers(tmp_path) == []
    res = verify(tmp_path)
    assert res == [(n, OK) for n in names]
    assert load_manifest(tmp_path).kind == "rotation-set"


def test_verify_detects_flip_missing_unlisted(tmp_path):
    make_files(tmp_path)
    pin(tmp_path)
    big = tmp_path / "sub" / "big.bin"
    data = bytearray(big.read_bytes())
    data[1 << 20] ^= 0x01  # same size, one bit changed in the second hashing chunk
    big.write_bytes(bytes(data))
    (tmp_path / "sub" / "deeper" / "empty.bin").unlink()
    (tmp_path / "sub" / "new.txt").write_bytes(b"extra")
    res = dict(verify(tmp_path))
    assert res == {"a.txt": OK, "sub/big.bin": FAILED, "sub/deeper/empty.bin": MISSING, "sub/new.txt": UNLISTED}


def test_verify_size_change_and_dir_replacing_file(tmp_path):
    make_files(tmp_path)
    pin(tmp_path)
    (tmp_path / "a.txt").write_bytes(b"hello\n!")
    (tmp_path / "sub" / "deeper" / "empty.bin").unlink()
    (tmp_path / "sub" / "deeper" / "empty.bin").mkdir()
    res = dict(verify(tmp_path))
    assert res["a.txt"] == FAILED and res["sub/deeper/empty.bin"] == FAILED


def test_pin_refuses_existing_manifest_and_keeps_it(tmp_path):
    make_files(tmp_path)
    pin(tmp_path)
    before = (tmp_path / MANIFEST_NAME).read_bytes()
    (tmp_path / "later.txt").write_bytes(b"x")
    with pytest.raises(LowbitError, match="already pinned.*lowbit verify"):
        pin(tmp_path)
    assert (tmp_path / MANIFEST_NAME).read_bytes() == before


def test_pin_errors(tmp_path):
    with pytest.raises(LowbitError, match="not a directory"):
        pin(tmp_path / "nope")
    with pytest.raises(LowbitError, match="unknown artifact class"):
        pin(tmp_path, "k", "packed")
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_load_manifest_missing_says_run_pin(tmp_path):
    with pytest.raises(LowbitError, match=r"no manifest.json; run `lowbit pin"):
        load_manifest(tmp_path)
    with pytest.raises(LowbitError, match="does not exist"):
        load_manifest(tmp_path / "nope")


def test_load_manifest_corrupt_json(tmp_path):
    make_files(tmp_path)
    pin(tmp_path)
    mp = tmp_path / MANIFEST_NAME
    mp.write_text(mp.read_text()[:-20])  # truncated
    with pytest.raises(LowbitError, match=r"not valid JSON \(line \d+ col \d+.*damaged"):
        load_manifest(tmp_path)
    mp.write_bytes(b"\xff\xfe{")
    with pytest.raises(LowbitError, match="not UTF-8"):
        load_manifest(tmp_path)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("files"), "'files' must be a list"),
        (lambda d: d.update(format="other"), "'format' must be"),
        (lambda d: d.update({"class": "fake-quant"}), "'class' 'fake-quant' is not one of"),
        (lambda d: d.update(counts=[1]), "'counts' must be a JSON object"),
        (lambda d: d.update(format_version=99), "newer than this lowbit reads"),
        (lambda d: d["files"][0].update(path="../etc/passwd"), "normalized relative path"),
        (lambda d: d["files"][0].update(path="/etc/passwd"), "normalized relative path"),
        (lambda d: d["files"][0].update(path="sub/./x"), "normalized relative path"),
        (lambda d: d["files"][0].update(sha256="ABC"), "64 lowercase hex"),
        (lambda d: d["files"][0].update(bytes=-1), "non-negative integer"),
        (lambda d: d["files"].append(dict(d["files"][0])), "listed twice"),
        (lambda d: d["files"][0].pop("sha256"), "exactly path, bytes, sha256"),
    ],
)
def test_load_manifest_wrong_schema(tmp_path, mutate, message):
    make_files(tmp_path)
    pin(tmp_path)
    mp = tmp_path / MANIFEST_NAME
    d = json.loads(mp.read_text())
    mutate(d)
    mp.write_text(json.dumps(d))
    with pytest.raises(LowbitError, match=message):
        load_manifest(tmp_path)
    with pytest.raises(LowbitError):
        verify(tmp_path)


def test_manifest_bytes_are_deterministic(tmp_path):
    write_artifact(tmp_path / "a")
    write_artifact(tmp_path / "b")
    assert (tmp_path / "a" / MANIFEST_NAME).read_bytes() == (tmp_path / "b" / MANIFEST_NAME).read_bytes()


def test_files_get_the_default_mode_even_from_safetensors(tmp_path):
    # safetensors' save_file wrote model.safetensors 0600 (a private temp file renamed) beside 0644 files
    import torch
    from safetensors.torch import save_file

    out = tmp_path / "art"
    with ArtifactWriter(out, kind="kv-eval", artifact_class="generic", inputs={"model": "m"}, recipe={}) as w:
        save_file({"a": torch.zeros(2)}, str(w.path / "model.safetensors"))
        (w.path / "config.json").write_text("{}")
        (w.path / "run.sh").write_text("#!/bin/sh\n")
        os.chmod(w.path / "run.sh", 0o700)
    plain = os.stat(out / "config.json").st_mode & 0o777
    assert os.stat(out / "model.safetensors").st_mode & 0o777 == plain
    assert plain & 0o044  # readable by group and others under the usual umask 022
    assert os.stat(out / "run.sh").st_mode & 0o100  # an executable stays executable


def test_readme_defines_every_artifact_class():
    # `lowbit validate` named classes ("native-packed") that the README never defined
    from pathlib import Path

    from lowbit.artifacts.manifest import ARTIFACT_CLASSES, CLASS_MEANING

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    concepts = readme.split("**Artifacts.**", 1)[1].split("\n## ", 1)[0]  # the Concepts paragraph and its list
    for cls in ARTIFACT_CLASSES:
        assert f"`{cls}`)" in concepts or f"- `{cls}`:" in concepts, cls  # each class named in the list
        assert CLASS_MEANING[cls]
