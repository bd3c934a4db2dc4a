from lowbit.artifacts import MANIFEST_NAME, load_manifest
from lowbit.cli import main


def make_files(root):
    (root / "sub").mkdir(parents=True)
    (root / "w.bin").write_bytes(bytes(range(256)) * 3)
    (root / "sub" / "r.pt").write_bytes(b"rotation")


def test_pin_then_verify_cli(tmp_path, capsys):
    make_files(tmp_path)
    assert main(["pin", str(tmp_path), "--kind", "rotation-set", "--class", "generic"]) == 0
    assert "pinned 2 files" in capsys.readouterr().out
    m = load_manifest(tmp_path)
    assert (m.kind, m.artifact_class) == ("rotation-set", "generic")
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["sub/r.pt: OK", "w.bin: OK"]
    assert "all 2 files OK" in out[2]


def test_verify_cli_reports_flip_missing_unlisted(tmp_path, capsys):
    make_files(tmp_path)
    assert main(["pin", str(tmp_path)]) == 0
    w = tmp_path / "w.bin"
    data = bytearray(w.read_bytes())
    data[99] ^= 0xFF
    w.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "w.bin: FAILED" in out.splitlines() and "sub/r.pt: OK" in out.splitlines()
    assert "1 failed, 0 missing, 0 unlisted" in out

    (tmp_path / "sub" / "r.pt").unlink()
    (tmp_path / "extra.txt").write_text("x")
    assert main(["verify", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["extra.txt: UNLISTED", "sub/r.pt: MISSING", "w.bin: FAILED"]
    assert "1 failed, 1 missing, 1 unlisted (0 of 2 listed files OK)" in lines[3]


def test_verify_cli_unlisted_alone_fails(tmp_path, capsys):
    make_files(tmp_path)
    main(["pin", str(tmp_path)])
    (tmp_path / "sub" / "late.bin").write_bytes(b"")
    assert main(["verify", str(tmp_path)]) == 1
    assert "sub/late.bin: UNLISTED" in capsys.readouterr().out


def test_cli_errors_exit_2_with_one_line(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "lowbit pin" in err and err.count("\n") == 1
    make_files(tmp_path)
    assert main(["pin", str(tmp_path)]) == 0
    assert main(["pin", str(tmp_path)]) == 2
    assert "already pinned" in capsys.readouterr().err
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    assert main(["verify", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
