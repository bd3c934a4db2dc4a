"""SIGKILL a real artifact writer at each point of its write and record what it leaves (issue #22).

    rows = kill_points(tmp_dir)   # [{"point", "before": [...], "after": [...], ...}] one per point
    write_results(rows, "results/reliability/kill_points.json")

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

from lowbit.artifacts.manifest import is_staging_dir
from lowbit.artifacts.verify import all_ok, verify
from lowbit.artifacts.writer import ArtifactWriter

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
    return _run_child_until(_CHILD, [str(parent / out_name)], point)


def _run_child_until(code: str, argv: list[str], point: str) -> int:
    """Run `python -c code *argv` (a child that prints each point and waits); SIGKILL it at `point`."""
    env_python = sys.executable
    child = subprocess.Popen([env_python, "-c", code, *argv], stdin=subprocess.PIPE,
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
            "staging_left_after": _staging_left(parent, pid),
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


# Single-file writes through writer.write_new_file: `lowbit pin DIR` (manifest.json) and `lowbit validate
# --json PATH` (write_report), each SIGKILLed at every one of its points, then the next run of the same command.
FILE_POINTS = ("staging-created", "partial-file", "file-written", "linked", "none")

_FILE_CHILD = r"""
import sys
from pathlib import Path

def stop(name):
    print(name, flush=True)
    sys.stdin.readline()  # the parent kills us here, or lets us go on

which, target = sys.argv[1], Path(sys.argv[2])
if which == "pin":
    from lowbit.artifacts.writer import pin
    pin(target, on_point=stop)
else:
    from lowbit.tools.validate import write_report
    write_report({"format": "test", "ok": True, "pad": "x" * 4000}, target, on_point=stop)
print("done", flush=True)
"""


def _next_run(which: str, target: Path, artifact: Path | None) -> tuple[int, str]:
    """The next run of the same command through the CLI, in a child process (`python -m lowbit`): `lowbit pin
    DIR`, or `lowbit validate ARTIFACT --stages 1 --json PATH` (a pinned "files" artifact: stage 1 fails on its
    kind, rc 1, report written). Returns (exit code, its stdout + stderr)."""
    argv = (["pin", str(target)] if which == "pin" else
            ["validate", str(artifact), "--stages", "1", "--device", "cpu", "--json", str(target)])
    p = subprocess.run([sys.executable, "-m", "lowbit", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, check=False)  # one stream, in the order the lines were written
    return p.returncode, p.stdout


def file_kill_point(parent: Path, which: str, point: str) -> dict:
    """One row for `which` ("pin" | "validate-json") killed at `point`: listings before / after the next run."""
    if which not in ("pin", "validate-json") or point not in FILE_POINTS:
        raise ValueError(f"unknown file kill point {which!r} / {point!r}")
    parent.mkdir(parents=True, exist_ok=True)
    if which == "pin":
        target = parent / "data"
        (target / "sub").mkdir(parents=True)
        (target / "a.bin").write_bytes(bytes(range(256)) * 4)
        (target / "sub" / "b.txt").write_text("b")
        done = target / "manifest.json"
    else:
        target = done = parent / "report.json"
        artifact = parent / "art"
        with ArtifactWriter(artifact, kind="files", artifact_class="generic", inputs={}, recipe={}) as w:
            (w.path / "x.txt").write_text("x")
    pid = _run_child_until(_FILE_CHILD, [which, str(target)], point)
    before = listing(parent, pid)
    if which == "pin":
        state = "absent" if not done.exists() else ("verifies" if all_ok(verify(target)) else "DAMAGED")
    else:
        try:
            state = "absent" if not done.exists() else ("whole" if json.loads(done.read_text())["ok"] else "DAMAGED")
        except (ValueError, KeyError):
            state = "DAMAGED"
    rc, said = _next_run(which, target, None if which == "pin" else artifact)
    after = listing(parent, pid)
    return {"command": which, "point": point, "before": before, "after": after, "output": state,
            "staging_left_after": _staging_left(parent, pid), "next_run_rc": rc,
            "next_run_said": [re.sub(rf"\b{pid}\b", "<pid>", ln.replace(str(parent), "<parent>"))
                              for ln in said.splitlines() if ln.startswith(("lowbit:", "error:", "pinned", "wrote"))]}


def _staging_left(parent: Path, pid: int) -> list[str]:
    """The staging dirs still directly in `parent` (their pid shown as <pid>)."""
    return sorted(re.sub(rf"\.tmp-{pid}\b", ".tmp-<pid>", n) + "/" for n in os.listdir(parent) if is_staging_dir(n))


def file_kill_points(root: Path) -> list[dict]:
    """file_kill_point for both commands at every point, each in its own fresh parent under `root`."""
    return [file_kill_point(Path(root) / f"{w}-{i}-{p}", w, p)
            for w in ("pin", "validate-json") for i, p in enumerate(FILE_POINTS)]
