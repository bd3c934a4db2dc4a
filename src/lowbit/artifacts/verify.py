"""Verify an artifact directory against its manifest, like `sha256sum -c` plus a completeness check."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import NamedTuple

from lowbit.artifacts.manifest import load_manifest, sha256_file
from lowbit.artifacts.writer import list_files
from lowbit.core.errors import LowbitError

OK = "OK"
FAILED = "FAILED"  # listed, present, but bytes differ (size or sha256), or no longer a regular file
MISSING = "MISSING"  # listed, not present
UNLISTED = "UNLISTED"  # present, not listed (any extra file means the artifact is not what was pinned)
STATUSES = (OK, FAILED, MISSING, UNLISTED)


class FileStatus(NamedTuple):
    path: str  # relative POSIX path inside the artifact
    status: str  # one of STATUSES


def verify(directory: str | os.PathLike) -> list[FileStatus]:
    """Check every listed file (size, then sha256) and look for unlisted ones.

    Returns [(path, status)] sorted by path; the artifact is intact iff every status is OK.
    A missing or unreadable manifest raises LowbitError (see load_manifest).
    """
    root = Path(directory)
    manifest = load_manifest(root)
    listed = manifest.file_map()
    out: list[FileStatus] = []
    for path, entry in listed.items():
        full = root / path
        try:
            st = os.lstat(full)
        except (FileNotFoundError, NotADirectoryError):
            out.append(FileStatus(path, MISSING))
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry.bytes:
            out.append(FileStatus(path, FAILED))  # cheap reject before hashing
            continue
        out.append(FileStatus(path, OK if sha256_file(full) == entry.sha256 else FAILED))
    present, others = list_files(root)
    for path in present + others:
        if path not in listed:
            out.append(FileStatus(path, UNLISTED))
    return sorted(out)


def all_ok(results: list[FileStatus]) -> bool:
    return all(r.status == OK for r in results)


_WHY = {FAILED: "its size or sha256 differs from the manifest", MISSING: "listed in the manifest but absent",
        UNLISTED: "present but not in the manifest"}


def require_intact(directory: str | os.PathLike, what: str = "artifact") -> None:
    """Raise one LowbitError naming the damaged files unless every file of `directory` verifies OK.

    What every loader calls before reading an artifact: a damaged manifest.json is named by
    load_manifest, a changed / missing / added file by its path here."""
    root = Path(directory)
    bad = [r for r in verify(root) if r.status != OK]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        names = "; ".join(f"{r.path} {r.status} ({_WHY[r.status]})" for r in bad[:3])
        raise LowbitError(f"{what} {root} does not match its manifest: {names}{more}; the artifact is damaged: "
                          "re-create it or copy it again")
