"""SIGKILL a real artifact writer at each point of its write and record what it leaves (issue #22).

    rows = kill_points(tmp_dir)   # [{"point", "before": [...], "after": [...], ...}] one per point
    write_results(rows, "benchmarks/results/reliability/kill_points.json")

The writer is a child `python -c` process running ArtifactWriter with its `on_point` hook: at each
point it prints the point's name and blocks reading a line from its stdin (a pipe). The parent
reads the names; at the chosen point it sends SIGKILL while the child is blocked there, so every
point is hit exactly, with no sleeps. "partial-file" is the child's own point, half-way through
writing a file into the staging directory. Then a "next run" (a new ArtifactWriter into the same
parent) must remove what the dead writer left, and the output must be absent or verify.

`before` / `after` list everything under the parent (directories end in "/", the writer's pid
written as <pid>), before and after the next run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from lowbit.artifacts.verify import all_ok, verify
from lowbit.artifacts.writer import ArtifactWriter, is_staging_dir

# In the order the write reaches them; "none" is the control (nothing killed).
POINTS = ("staging-created", "partial-file", "files-written", "manifest-written", "renamed", "none")

_CHILD = r"""
import sys
from lowbit.artifacts.writer import ArtifactWriter

def stop(name):
    print(name, flush=True)
    sys.stdin.readline()  # the parent kills us here, or lets us go on

with ArtifactWriter(sys.argv[1], kind="files", artifact_class="generic", inputs={}, recipe={}, on_point=stop) as w:
    with open(w.path / "a.bin", "wb") as f:
        f.write(bytes(range(256)) * 8)
        f.flush()
        stop("partial-file")
        f.write(bytes(range(256)) * 8)
    (w.path / "sub").mkdir()
    (w.path / "sub" / "b.json").write_text('{"x": 1}')
print("done", flush=True)
"""


def listing(parent: Path, pid: int | None = None) -> list[str]:
    """Everything under `parent`, sorted, as relative paths (dirs end in '/'; `pid` shown as <pid>)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(parent):
        rel = Path(dirpath).relative_to(parent)
        out += [(rel / d).as_posix() + "/" for d in dirnames] + [(rel / f).as_posix() for f in filenames]
    if pid is not None:
        out = [re.sub(rf"\.tmp-{pid}\b", ".tmp-<pid>", p) for p in out]
    return sorted(out)


def run_writer_until(parent: Path, point: str, out_name: str = "out") -> int:
    """Run the child writer into parent/out_name; SIGKILL it at `point` ("none": let it finish). Returns its pid."""
    if point not in POINTS:
        raise ValueError(f"unknown kill point {point!r}; one of {POINTS}")
    env_python = sys.executable
    child = subprocess.Popen([env_python, "-c", _CHILD, str(parent / out_name)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in child.stdout:
            name = line.strip()
            seen.append(name)
            if name == point:
                child.send_signal(signal.SIGKILL)
                break
            if name == "done":
                break
            child.stdin.write("\n")
            child.stdin.flush()
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    err = child.stderr.read()
    for f in (child.stdin, child.stdout, child.stderr):
        with contextlib.suppress(OSError):
            f.close()
    if point == "none":
        if child.returncode != 0 or "done" not in seen:
            raise RuntimeError(f"the writer failed (rc {child.returncode}): {err.strip()}")
    elif child.returncode != -signal.SIGKILL or point not in seen:
        raise RuntimeError(f"the writer never reached {point!r} (saw {seen}, rc {child.returncode}): {err.strip()}")
    return child.pid


def kill_point(parent: Path, point: str) -> dict:
    """One row: kill at `point`, list, do the next write into the same parent, list again."""
    parent.mkdir(parents=True, exist_ok=True)
    pid = run_writer_until(parent, point)
    before = listing(parent, pid)
    out = parent / "out"
    out_state = "absent" if not out.exists() else ("verifies" if all_ok(verify(out)) else "DAMAGED")
    said = io.StringIO()
    with contextlib.redirect_stderr(said), ArtifactWriter(parent / "next", kind="files", artifact_class="generic",
                                                          inputs={}, recipe={}) as w:  # stderr: the sweep's line
        (w.path / "n.txt").write_text("next")
    after = listing(parent, pid)
    return {"point": point, "before": before, "after": after, "output": out_state,
            "staging_left_after": [p for p in after if is_staging_dir(p.rstrip("/").split("/")[0])],
            "next_run_said": [re.sub(rf"\b{pid}\b", "<pid>", s.replace(str(parent), "<parent>"))
                              for s in said.getvalue().splitlines()]}


def kill_points(root: Path, points=POINTS) -> list[dict]:
    """kill_point for every point, each in its own fresh parent under `root`."""
    return [kill_point(Path(root) / f"p{i}-{p}", p) for i, p in enumerate(points)]


def write_results(rows: list[dict], path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"kill_points": rows}, indent=1) + "\n")
    return p
