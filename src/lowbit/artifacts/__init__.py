"""Artifacts: immutable directories pinned by a manifest (inputs, recipe, versions, files with sha256, counts).

    manifest.py  Manifest / FileEntry, load_manifest, require_class, sha256_file
    writer.py    ArtifactWriter (atomic write into a new directory), pin (manifest for existing files),
                 sweep_stale (remove killed writers' staging dirs)
    verify.py    verify (per-file OK / FAILED / MISSING / UNLISTED), require_intact (loaders: raise naming the file)
"""

from lowbit.artifacts.manifest import (
    ARTIFACT_CLASSES,
    FORMAT_VERSION,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    load_manifest,
    require_class,
    sha256_file,
)
from lowbit.artifacts.verify import FAILED, MISSING, OK, UNLISTED, FileStatus, all_ok, require_intact, verify
from lowbit.artifacts.writer import ArtifactWriter, pin, sweep_stale

__all__ = [
    "ARTIFACT_CLASSES",
    "FAILED",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MISSING",
    "OK",
    "UNLISTED",
    "ArtifactWriter",
    "FileEntry",
    "FileStatus",
    "Manifest",
    "all_ok",
    "load_manifest",
    "pin",
    "require_class",
    "require_intact",
    "sha256_file",
    "sweep_stale",
    "verify",
]
