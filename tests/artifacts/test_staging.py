"""Stale staging directories (issue #22): a writer SIGKILLed at every point of its write leaves either no
output or one that verifies, and the next write / `lowbit verify` / `lowbit validate` on the parent removes
what it left, in one line; a live writer's staging dir is never removed; a staging dir is never read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from lowbit.artifacts import ArtifactWriter, load_manifest, sweep_stale, verify
from lowbit.artifacts.manifest import is_staging_dir, staging_name
from lowbit.cli import main
from lowbit.core.errors import LowbitError
from lowbit.tools.killpoints import _CHILD, POINTS, kill_point, listing


def _staging(parent):
    return [p for p in os.listdir(parent) if is_staging_dir(p)]


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_at_each_point_leaves_no_output_or_a_verified_one_and_the_next_run_cleans_up(tmp_path, point):
    row = kill_point(tmp_path, point)
    print(row)
    assert row["output"] in ("absent", "verifies")
    killed_before_rename = POINTS.index(point) < POINTS.index("renamed")
    assert row["output"] == ("absent" if killed_before_rename else "verifies")
    if killed_before_rename:  # the dead writer's leftovers were really there, then really gone
        assert row["before"] and all(p.startswith(".out.tmp-<pid>/") for p in row["before"])
        assert len(row["next_run_said"]) == 1 and "removed stale staging directory" in row["next_run_said"][0]
        assert "pid <pid>" in row["next_run_said"][0] and "is gone" in row["next_run_said"][0]
    else:
        assert "out/manifest.json" in row["before"] and row["next_run_said"] == []
    if point == "partial-file":
        assert row["before"] == [".out.tmp-<pid>/", ".out.tmp-<pid>/a.bin"]
    assert row["staging_left_after"] == [] and not _staging(tmp_path)
    assert "next/manifest.json" in row["after"]


def _blocked_writer(parent, point):
    """A child writer stopped (alive) at `point`; returns the Popen (stdin: a newline lets it go on)."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(parent / "out")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in child.stdout:
        if line.strip() == point:
            return child
        child.stdin.write("\n")
        child.stdin.flush()
    raise AssertionError(f"writer exited before {point}: {child.stderr.read()}")


def test_a_live_writers_staging_dir_is_left_alone_and_it_still_finishes(tmp_path, capsys):
    child = _blocked_writer(tmp_path, "files-written")
    try:
        staged = _staging(tmp_path)
        assert staged == [staging_name("out", child.pid)]
        assert sweep_stale(tmp_path) == []  # locked: its writer is alive
        with ArtifactWriter(tmp_path / "other", kind="k", artifact_class="generic", inputs={}, recipe={}) as w:
            (w.path / "x").write_text("x")
        assert _staging(tmp_path) == staged and capsys.readouterr().err == ""
        for _ in range(3):  # files-written -> manifest-written -> renamed -> done
            child.stdin.write("\n")
            child.stdin.flush()
        _, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert not _staging(tmp_path) and all(s.status == "OK" for s in verify(tmp_path / "out"))


def test_a_dead_writer_is_not_taken_for_alive_by_a_reused_pid(tmp_path, capsys):
    # The name carries a pid that is alive (ours) but nothing holds the directory's lock: stale.
    stale = tmp_path / staging_name("out", os.getpid())
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "half.bin").write_bytes(b"\0" * 3)
    assert sweep_stale(tmp_path) == [stale] and not stale.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(stale) in err[0] and "removed stale staging directory" in err[0]
    # the same name again is then free for this process's own write
    with ArtifactWriter(tmp_path / "out", kind="k", artifact_class="generic", inputs={}, recipe={}) as w:
        (w.path / "x").write_text("x")
    assert not _staging(tmp_path)


def _dead_writer_dir(parent, point="partial-file"):
    from lowbit.tools.killpoints import run_writer_until

    pid = run_writer_until(parent, point)
    assert _staging(parent) == [staging_name("out", pid)]
    return parent / staging_name("out", pid)


def test_lowbit_verify_on_the_parent_or_a_sibling_removes_stale_staging(tmp_path, capsys):
    with ArtifactWriter(tmp_path / "good", kind="k", artifact_class="generic", inputs={}, recipe={}) as w:
        (w.path / "x").write_text("x")
    stale = _dead_writer_dir(tmp_path)
    assert main(["verify", str(tmp_path / "good")]) == 0
    err = capsys.readouterr().err
    assert f"removed stale staging directory {stale}" in err and not _staging(tmp_path)
    stale = _dead_writer_dir(tmp_path, "manifest-written")
    assert main(["verify", str(tmp_path)]) == 2  # the parent is no artifact, but its stale staging goes first
    err = capsys.readouterr().err
    assert f"removed stale staging directory {stale}" in err and "has no manifest.json" in err
    assert not _staging(tmp_path)


def test_lowbit_validate_on_a_sibling_removes_stale_staging(tmp_path, capsys):
    stale = _dead_writer_dir(tmp_path, "files-written")
    with ArtifactWriter(tmp_path / "rot", kind="files", artifact_class="generic", inputs={}, recipe={}) as w:
        (w.path / "x").write_text("x")  # (the write itself sweeps too: make a new dead one after it)
    stale = _dead_writer_dir(tmp_path, "staging-created")
    assert main(["validate", str(tmp_path / "rot"), "--stages", "1", "--device", "cpu"]) == 1  # kind 'files'
    assert f"removed stale staging directory {stale}" in capsys.readouterr().err and not _staging(tmp_path)


def test_a_staging_dir_is_never_read_as_an_artifact(tmp_path, capsys):
    child = _blocked_writer(tmp_path, "manifest-written")  # a complete manifest inside, not yet renamed
    try:
        staged = tmp_path / _staging(tmp_path)[0]
        assert (staged / "manifest.json").is_file()
        for call in (load_manifest, verify):
            with pytest.raises(LowbitError, match="staging directory of an unfinished"):
                call(staged)
        assert main(["verify", str(staged)]) == 2
        assert "staging directory of an unfinished" in capsys.readouterr().err
        assert staged.is_dir()  # its writer is alive: not swept
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert listing(tmp_path, child.pid)[0] == ".out.tmp-<pid>/"


def test_the_committed_kill_points_json_is_what_the_harness_gives(tmp_path):
    import json
    from pathlib import Path

    from lowbit.tools.killpoints import kill_points

    committed = Path(__file__).parents[2] / "results/reliability/kill_points.json"
    assert json.loads(committed.read_text()) == {"kill_points": kill_points(tmp_path)}
