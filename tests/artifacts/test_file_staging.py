"""Single-file writes (`lowbit pin`'s manifest.json, `lowbit validate --json`'s report) go through the same
flock'ed staging as artifacts (issue #22): SIGKILLed at each point they leave no file or a whole one, plus at
most a staging dir that the next run of the same command removes in one line; the pinned dir never holds a
temporary of its own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lowbit.artifacts import verify
from lowbit.artifacts.manifest import is_staging_dir, staging_name
from lowbit.artifacts.writer import write_new_file
from lowbit.tools.killpoints import FILE_POINTS, file_kill_point, file_kill_points


def _staging(parent):
    return [p for p in os.listdir(parent) if is_staging_dir(p)]


@pytest.mark.parametrize("which", ["pin", "validate-json"])
@pytest.mark.parametrize("point", FILE_POINTS)
def test_sigkill_at_each_point_leaves_nothing_or_a_whole_file_and_the_next_run_cleans_up(tmp_path, which, point):
    row = file_kill_point(tmp_path, which, point)
    print(row)
    linked = FILE_POINTS.index(point) >= FILE_POINTS.index("linked")
    whole = "verifies" if which == "pin" else "whole"
    assert row["output"] == (whole if linked else "absent")
    stage = ".data.manifest.json.tmp-<pid>/" if which == "pin" else ".report.json.tmp-<pid>/"
    if point != "none":  # the dead writer's leftover was really there, then the next run removed it
        assert stage in row["before"]
        assert "removed stale staging directory" in row["next_run_said"][0] and "pid <pid>" in row["next_run_said"][0]
    else:
        assert not [p for p in row["before"] if ".tmp-" in p]
    if point == "partial-file":
        name = "manifest.json" if which == "pin" else "report.json"
        assert stage + name in row["before"]
    assert row["staging_left_after"] == [] and not _staging(tmp_path) and not [p for p in row["after"] if ".tmp-" in p]
    if which == "pin":  # nothing but the files and (once linked) the manifest ever inside the pinned dir
        inside = {p for p in row["before"] if p.startswith("data/")}
        assert inside == {"data/", "data/a.bin", "data/sub/", "data/sub/b.txt"} | ({"data/manifest.json"} if linked else set())
        assert all(s.status == "OK" for s in verify(tmp_path / "data"))
        assert row["next_run_rc"] == (2 if linked else 0)  # already pinned / pinned now
    else:
        assert json.loads((tmp_path / "report.json").read_text())["format"]
        assert row["next_run_rc"] == (2 if linked else 1)  # exists, refused / written (stage 1 fails on kind)


def test_write_new_file_never_replaces_and_an_error_inside_leaves_nothing(tmp_path):
    t = tmp_path / "r.json"
    assert write_new_file(t, b"one") == t and t.read_bytes() == b"one" and not _staging(tmp_path)
    with pytest.raises(FileExistsError):
        write_new_file(t, b"two")
    assert t.read_bytes() == b"one" and not _staging(tmp_path)

    def boom(point):
        if point == "file-written":
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_new_file(tmp_path / "s.json", b"x" * 99, on_point=boom)
    assert not (tmp_path / "s.json").exists() and not _staging(tmp_path)


def test_a_live_writers_staged_file_is_not_swept_by_another_write(tmp_path, capsys):
    seen = []

    def nested(point):
        if point == "file-written":  # while this write is staged, a second one into the same dir sweeps it
            write_new_file(tmp_path / "other.json", b"o")
            seen.append(sorted(_staging(tmp_path)))

    write_new_file(tmp_path / "r.json", b"r" * 7, on_point=nested)
    assert seen == [[staging_name("r.json")]] and capsys.readouterr().err == ""
    assert (tmp_path / "r.json").read_bytes() == b"r" * 7 and not _staging(tmp_path)


def test_the_committed_file_kill_points_json_is_what_the_harness_gives(tmp_path):
    committed = Path(__file__).parents[2] / "results/reliability/file_kill_points.json"
    assert json.loads(committed.read_text()) == {"file_kill_points": file_kill_points(tmp_path)}
