"""Writing artifacts: atomically into a new directory (ArtifactWriter), or pinning existing files (pin).

Atomic means a reader sees either no `out_dir` or a complete one with its manifest: files are
staged in a sibling `.<name>.tmp-<pid>` directory (same filesystem, so os.rename is atomic) and
renamed into place only after manifest.json is written and synced. An existing `out_dir` is
never overwritten: artifacts are immutable, a new result goes to a new directory.

Stale staging directories. A writer killed outright (SIGKILL, OOM, power loss) leaves its
`.<name>.tmp-<pid>` behind. Liveness is an flock: the writer holds LOCK_EX on the staging
directory itself from the moment it exists until it is renamed or removed, and the kernel drops
that lock when the process dies however it dies. So a staging directory whose lock can be taken
has no writer; a reused pid (the number in the name is only for people) can never make a dead
writer look alive, and a live one is never removed. Creating a staging directory and sweeping
happen under an flock on the parent directory, so a sweeper never sees a staging directory in
the instant between mkdir and its lock. `sweep_stale(parent)` removes the stale ones with one
line each on stderr; every ArtifactWriter does it on entry, `lowbit verify` / `lowbit validate`
on the artifact's parent. (flock is per open file description and not inherited across exec;
on filesystems where flock is a no-op or unsupported, sweeping is skipped rather than guessed.)

Single files (pin's manifest.json, `lowbit validate --json`'s report) go through the same staging:
`write_new_file` stages the file in a flock'ed staging directory, hard-links it into place and removes
the directory, so a killed write's leftover is a staging dir like any other and the same sweep removes it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Self

from lowbit.artifacts.manifest import (
    MANIFEST_NAME,
    STAGING_RE,
    FileEntry,
    Manifest,
    check_class,
    library_versions,
    sha256_file,
    staging_name,
)
from lowbit.core.errors import LowbitError


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _try_lock(fd: int) -> bool | None:
    """Take LOCK_EX without waiting: True taken, False held by someone else, None flock unsupported here."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


def _sweep_locked(parent: Path) -> list[Path]:
    """sweep_stale's body; the caller holds the parent's flock."""
    removed = []
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return removed
    for name in names:
        m = STAGING_RE.fullmatch(name)
        if m is None:
            continue
        cand = parent / name
        try:
            fd = _open_dir(cand)  # O_NOFOLLOW: a symlink or a file of that name is not ours to remove
        except OSError:
            continue
        try:
            if _try_lock(fd) is not True:
                continue  # its writer is alive (or flock cannot tell us): leave it
            try:
                shutil.rmtree(cand)
            except OSError as e:
                print(f"lowbit: stale staging directory {cand} (writer pid {m['pid']} is gone) could not be "
                      f"removed ({e.strerror}); delete it by hand", file=sys.stderr)
                continue
            print(f"lowbit: removed stale staging directory {cand} (its writer, pid {m['pid']}, is gone)",
                  file=sys.stderr)
            removed.append(cand)
        finally:
            os.close(fd)
    return removed


def sweep_stale(parent: str | os.PathLike) -> list[Path]:
    """Remove every staging directory in `parent` whose writer process is gone; returns what was removed.

    One line on stderr per directory removed. A live writer's staging directory is left alone;
    a missing or unreadable parent is nothing to sweep."""
    parent = Path(parent)
    try:
        pfd = _open_dir(parent)
    except OSError:
        return []
    try:
        try:
            fcntl.flock(pfd, fcntl.LOCK_EX)  # waits only while a writer creates its staging dir
        except OSError:
            return []
        return _sweep_locked(parent)
    finally:
        os.close(pfd)


def _make_staging(staging: Path) -> int:
    """Create the staging directory `staging` and lock it (LOCK_EX, held by the returned fd until the caller
    closes it: its liveness). Under the parent's flock, after sweeping the parent's dead writers' leftovers.
    FileExistsError: a live staging dir of that name (this pid) exists."""
    parent = staging.parent
    pfd = _open_dir(parent)
    try:
        try:
            fcntl.flock(pfd, fcntl.LOCK_EX)  # waits only while another writer creates or a sweeper sweeps
            parent_locked = True
        except OSError:
            parent_locked = False  # flock unsupported on this filesystem: no sweeping, no liveness
        if parent_locked:
            _sweep_locked(parent)  # the dead writers' leftovers, before this one adds its own
        staging.mkdir()
        fd = _open_dir(staging)
        if parent_locked:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held until the rename (or removal): our liveness
        return fd
    finally:
        os.close(pfd)  # releases the parent lock


FILE_POINTS = ("staging-created", "partial-file", "file-written", "linked")


def write_new_file(target: str | os.PathLike, data: bytes, *, stage_as: tuple[Path, str] | None = None,
                   on_point: Callable[[str], None] | None = None) -> Path:
    """Create the new file `target` holding `data`: whole or not at all, never over an existing file.

    Staged like an artifact: written and fsync'ed as `<stage dir>/<name>` inside a flock'ed staging directory
    `.<stage name>.tmp-<pid>` (what sweep_stale removes once its writer is dead; entering sweeps the dead ones
    first), then hard-linked to `target` (which fails rather than replaces), then the staging dir is removed.
    A SIGKILL at any point leaves no target or a complete one, plus at most a staging dir the next sweep
    of that directory removes. `stage_as` = (directory, name) to stage in (default: target's directory
    and name; pin stages a manifest beside the directory it pins, so the pinned directory never holds a
    temporary). FileExistsError: `target` exists. Where the staging directory cannot be made (read-only)
    or hard links are unsupported, falls back to an exclusive create of `target` (never overwrites; a
    crash mid-write may then leave it partial). `on_point`: test hook called at each of FILE_POINTS.
    """
    target = Path(target)
    point = on_point or (lambda name: None)
    stage_dir, stage_name = stage_as or (target.parent, target.name)
    staging = Path(stage_dir) / staging_name(stage_name)
    try:
        fd = _make_staging(staging)
    except FileExistsError:
        raise LowbitError(f"staging directory {staging} exists and its writer is still running (another "
                          f"write to {target} from this process?): wait for it to finish") from None
    except OSError:
        fd = None  # cannot stage there (read-only directory, ...): exclusive create only
    if fd is None:
        _write_exclusive(target, data)
        return target
    try:
        point("staging-created")
        staged = staging / target.name
        with open(staged, "xb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            point("partial-file")
            f.write(data[len(data) // 2:])
            f.flush()
            os.fsync(f.fileno())
        point("file-written")
        try:
            os.link(staged, target)  # FileExistsError when target appeared: propagates
        except FileExistsError:
            raise
        except OSError:  # no hard links here (or another filesystem): exclusive create still never overwrites
            _write_exclusive(target, data)
        point("linked")
        _fsync_path(target.parent)
        shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        os.close(fd)  # the lock goes only once the staging dir is removed
    return target


def _write_exclusive(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:  # "x": never clobber an existing file
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def list_files(root: Path) -> tuple[list[str], list[str]]:
    """Walk `root` recursively without following links. Returns (regular files, others) as sorted
    relative POSIX paths, excluding the top-level manifest.json; "others" are symlinks (to files or
    dirs) and special files (fifos, sockets, devices), which an artifact may not contain."""
    files, others = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root)
        linked_dirs = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in filenames + linked_dirs:
            rel = (rel_dir / name).as_posix()
            if rel == MANIFEST_NAME:
                continue
            mode = os.lstat(os.path.join(dirpath, name)).st_mode
            (files if stat.S_ISREG(mode) else others).append(rel)
    return sorted(files), sorted(others)


def _hash_entries(root: Path) -> tuple[FileEntry, ...]:
    files, others = list_files(root)
    if others:
        # An artifact must be self-contained: a link's target can change without the manifest noticing.
        raise LowbitError(
            f"{root} contains symlinks or special files ({', '.join(others[:3])}); copy the real files in instead"
        )
    return tuple(FileEntry(p, (root / p).stat().st_size, sha256_file(root / p)) for p in files)


def _check_dict(name: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise LowbitError(f"artifact {name} must be a dict, got {type(value).__name__}")
    return value


def _default_modes(root: Path) -> None:
    """Give every file under `root` the mode a plain open() gives (0666 less the umask): safetensors'
    save_file writes through a private temp file, so model.safetensors came out 0600 beside 0644 files
    and another user of a shared artifact could not read the weights."""
    umask = os.umask(0)
    os.umask(umask)  # reading the umask means setting it; put it straight back
    mode = 0o666 & ~umask
    for dirpath, _, names in os.walk(root):
        for n in names:
            f = Path(dirpath) / n
            if f.is_symlink():
                continue
            have = f.stat().st_mode & 0o777
            want = mode | (have & 0o111 & ~umask)  # an executable stays executable
            if have != want:
                os.chmod(f, want)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest_file(path: Path, text: str) -> None:
    with open(path, "x", encoding="utf-8") as f:  # "x": never clobber an existing file
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class ArtifactWriter:
    """Write an artifact atomically into a new directory.

        with ArtifactWriter(out, kind="kv-eval", artifact_class="fake-quant-eval",
                            inputs={"model": name, "weights_sha256": sha}, recipe=recipe_dict) as w:
            torch.save(t, w.path / "codes.pt")        # any files, any sub-directories
            w.counts = {"layers": 30, "quantized_modules": 60, "skipped": 0}
        w.manifest  # the written Manifest; out now exists with manifest.json

    `w.inputs`, `w.recipe`, `w.counts` may be reassigned inside the block (plain JSON dicts).
    On an exception inside the block the staging dir is removed and the exception propagates.
    Refuses an existing out_dir (at enter and again just before the rename).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        kind: str,
        artifact_class: str,
        inputs: dict[str, Any],
        recipe: dict[str, Any],
        on_point: Callable[[str], None] | None = None,
    ):
        if not isinstance(kind, str) or not kind:
            raise LowbitError(f"artifact kind must be a non-empty string, got {kind!r}")
        self.out_dir = Path(out_dir)
        if not self.out_dir.name or self.out_dir.name in (".", ".."):
            raise LowbitError(f"artifact output {out_dir!s} must name a new directory")
        self.kind = kind
        self.artifact_class = check_class(artifact_class)
        self.inputs = _check_dict("inputs", inputs)
        self.recipe = _check_dict("recipe", recipe)
        self.counts: dict[str, Any] = {}
        self.manifest: Manifest | None = None
        self._staging: Path | None = None
        self._lock_fd: int | None = None
        # Tests only: called with the name of each point of the write (POINTS) as it is reached, so a
        # test can stop a real writer exactly there (and SIGKILL it) without sleeping.
        self._on_point = on_point

    POINTS = ("staging-created", "files-written", "manifest-written", "renamed")

    def _point(self, name: str) -> None:
        if self._on_point is not None:
            self._on_point(name)

    @property
    def path(self) -> Path:
        """The staging directory to write files into (valid only inside the `with` block)."""
        if self._staging is None:
            raise LowbitError("ArtifactWriter.path is only available inside `with ArtifactWriter(...) as w:`")
        return self._staging

    def _refuse_existing(self) -> None:
        if os.path.lexists(self.out_dir):
            raise LowbitError(
                f"{self.out_dir} already exists; artifacts are never overwritten: choose a new output directory"
            )

    def __enter__(self) -> Self:
        if self._staging is not None or self.manifest is not None:
            raise LowbitError("an ArtifactWriter writes one artifact once; create a new writer")
        self._refuse_existing()
        parent = self.out_dir.parent
        parent.mkdir(parents=True, exist_ok=True)
        staging = parent / staging_name(self.out_dir.name)
        try:
            self._lock_fd = _make_staging(staging)
        except FileExistsError:
            raise LowbitError(
                f"staging directory {staging} exists and its writer is still running (another write to "
                f"{self.out_dir} from this process?): wait for it to finish"
            ) from None
        self._staging = staging
        self._point("staging-created")
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        staging, self._staging = self._staging, None
        try:
            if exc_type is not None:
                shutil.rmtree(staging, ignore_errors=True)
                return False  # propagate
            try:
                self.manifest = self._finish(staging)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            return False
        finally:
            fd, self._lock_fd = self._lock_fd, None
            if fd is not None:
                os.close(fd)  # the lock goes only once the staging dir is renamed or removed

    def _finish(self, staging: Path) -> Manifest:
        if os.path.lexists(staging / MANIFEST_NAME):
            raise LowbitError(f"{MANIFEST_NAME} is written by ArtifactWriter itself; do not write a file of that name")
        self._point("files-written")
        _default_modes(staging)
        manifest = Manifest(
            kind=self.kind,
            artifact_class=self.artifact_class,
            inputs=_check_dict("inputs", self.inputs),
            recipe=_check_dict("recipe", self.recipe),
            versions=library_versions(),
            counts=_check_dict("counts", self.counts),
            files=_hash_entries(staging),
        )
        _write_manifest_file(staging / MANIFEST_NAME, manifest.to_json())
        self._point("manifest-written")
        self._refuse_existing()
        # os.rename would silently replace an existing *empty* directory, hence the check just above;
        # a non-empty one makes it fail, which we report the same way.
        try:
            os.rename(staging, self.out_dir)
        except OSError as e:
            if os.path.lexists(self.out_dir):
                self._refuse_existing()
            raise LowbitError(f"could not move {staging} to {self.out_dir}: {e.strerror}") from None
        self._point("renamed")
        _fsync_path(self.out_dir.parent)  # make the rename itself durable
        return replace(manifest, root=self.out_dir)


def pin(
    directory: str | os.PathLike,
    kind: str = "files",
    artifact_class: str = "generic",
    *,
    inputs: dict[str, Any] | None = None,
    recipe: dict[str, Any] | None = None,
    counts: dict[str, Any] | None = None,
    on_point: Callable[[str], None] | None = None,
) -> Manifest:
    """Write manifest.json for a directory of existing files (every file, recursively).

    Refuses a directory that already has a manifest (pinning again would bless whatever changed
    since; run verify instead). The manifest appears atomically through write_new_file, staged in a
    `.<dir>.manifest.json.tmp-<pid>` staging directory beside the pinned one (never inside it, so a
    killed pin leaves nothing to be pinned or flagged next time; the next pin, write, verify or validate
    beside it sweeps it), then hard-linked into place (which fails rather than overwrites if one
    appeared meanwhile). `on_point`: test hook (write_new_file's FILE_POINTS).
    """
    root = Path(directory)
    if not root.is_dir():
        raise LowbitError(f"cannot pin {root}: not a directory")
    sweep_stale(root.resolve().parent)  # a killed pin's staging dir (and other dead writers') beside it
    if not isinstance(kind, str) or not kind:
        raise LowbitError(f"artifact kind must be a non-empty string, got {kind!r}")
    check_class(artifact_class)
    target = root / MANIFEST_NAME
    if os.path.lexists(target):
        raise LowbitError(f"{root} is already pinned ({MANIFEST_NAME} exists); run `lowbit verify {root}` instead")
    manifest = Manifest(
        kind=kind,
        artifact_class=artifact_class,
        inputs=_check_dict("inputs", inputs or {}),
        recipe=_check_dict("recipe", recipe or {}),
        versions=library_versions(),
        counts=_check_dict("counts", counts or {}),
        files=_hash_entries(root),  # listed before the temp file exists, so it is never included
        root=root,
    )
    full = root.resolve()
    stage_as = (full.parent, f"{full.name}.{MANIFEST_NAME}") if full.name else None
    try:
        write_new_file(target, manifest.to_json().encode("utf-8"), stage_as=stage_as, on_point=on_point)
    except FileExistsError:
        raise LowbitError(f"{root} was pinned by someone else meanwhile; run `lowbit verify {root}`") from None
    return manifest
