"""The artifact manifest: what an artifact directory holds and how it was made.

Every artifact directory carries `manifest.json`:

    {
      "format": "lowbit-artifact",
      "format_version": 1,
      "kind": "kv-eval",                      # what the artifact is (free-form, non-empty)
      "class": "fake-quant-eval",             # one of ARTIFACT_CLASSES; classes never mix
      "inputs": {"model": "...", "weights_sha256": "..."},
      "recipe": {...},
      "versions": {"lowbit": "0.1.0", "torch": "2.13.0", "transformers": "5.24.0", "python": "3.11.9"},
      "counts": {"layers": 30, "quantized_modules": 210, "skipped": 0},
      "files": [{"path": "sub/dir/x.safetensors", "bytes": 123, "sha256": "<64 hex>"}, ...]
    }

`files` lists every regular file under the directory, recursively, as a relative POSIX path,
sorted, except manifest.json itself. The manifest is written without a timestamp so the same
artifact always gets the same manifest bytes.

The last key, "self_sha256", seals manifest.json itself: the sha256 of the file's exact bytes
with that value written as 64 zeros. Without it a flipped byte in `recipe`, `inputs` or `counts`
(or whitespace turned into other whitespace) would still parse and every digest would still
match. load_manifest checks it when present; a manifest without it (hand-edited, or written
before the seal) is read unsealed. Top-level keys other than these are refused, so a damaged
key name cannot hide the seal.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any

from lowbit import __version__
from lowbit.core.errors import LowbitError

MANIFEST_NAME = "manifest.json"
FORMAT = "lowbit-artifact"
FORMAT_VERSION = 1

# Fake-quant evaluation artifacts hold dequantized (model-dtype) tensors and give quality numbers;
# native-packed artifacts hold packed codes + scales for the runtime. Their numbers are not
# comparable (the field paid for mixing two similarly named classes), so the set is closed.
# "generic" is for artifacts that are neither (rotation sets, calibration dumps, reports, pinned files).
ARTIFACT_CLASSES = ("fake-quant-eval", "native-packed", "generic")
# what each class means, in the words the README's class table uses (errors that name a class say it)
CLASS_MEANING = {
    "native-packed": "packed low-bit codes + scales, as `lowbit quantize` and `lowbit export` write",
    "fake-quant-eval": "quantized-then-dequantized tensors for quality numbers only",
    "generic": "neither: rotation sets, calibration statistics, pinned files",
}

_CHUNK = 1 << 20  # 1 MiB: keeps hashing of multi-GB weight files at constant memory
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
SEAL_KEY = "self_sha256"
_SEAL_ZERO = "0" * 64
_KEYS = {"format", "format_version", "kind", "class", "inputs", "recipe", "versions", "counts", "files", SEAL_KEY}


def _seal_text(text: str, value: str) -> str:
    """`text` (ending in the seal entry) with the seal's 64 hex replaced by `value`."""
    head, sep, tail = text.rpartition(f'"{SEAL_KEY}": "')
    return head + sep + value + tail[64:]


def _seal_of(text: str) -> str:
    return hashlib.sha256(_seal_text(text, _SEAL_ZERO).encode("utf-8")).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def library_versions() -> dict[str, str | None]:
    """Versions recorded in every manifest (None for a package that is not installed).

    Read from package metadata so writing a manifest never imports torch or transformers.
    """
    out: dict[str, str | None] = {"lowbit": __version__}
    for pkg in ("torch", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    out["python"] = platform.python_version()
    return out


def check_class(artifact_class: str) -> str:
    """Return artifact_class if it is one of ARTIFACT_CLASSES, else raise LowbitError."""
    if artifact_class not in ARTIFACT_CLASSES:
        raise LowbitError(f"unknown artifact class {artifact_class!r}: use one of {', '.join(ARTIFACT_CLASSES)}")
    return artifact_class


@dataclass(frozen=True)
class FileEntry:
    """One file of an artifact: `path` relative to the artifact dir (POSIX), size in bytes, hex sha256."""

    path: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """Parsed manifest.json. `root` is the directory it was loaded from (None when built in memory)."""

    kind: str
    artifact_class: str
    inputs: dict[str, Any]
    recipe: dict[str, Any]
    versions: dict[str, Any]
    counts: dict[str, Any]
    files: tuple[FileEntry, ...]
    format_version: int = FORMAT_VERSION
    root: Path | None = field(default=None, compare=False)

    def file_map(self) -> dict[str, FileEntry]:
        return {e.path: e for e in self.files}

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "kind": self.kind,
            "class": self.artifact_class,
            "inputs": self.inputs,
            "recipe": self.recipe,
            "versions": self.versions,
            "counts": self.counts,
            "files": [{"path": e.path, "bytes": e.bytes, "sha256": e.sha256} for e in self.files],
        }

    def to_json(self) -> str:
        """Strict JSON (no NaN/Infinity), fixed key order, trailing newline, sealed (self_sha256 last)."""
        try:
            text = json.dumps({**self.to_dict(), SEAL_KEY: _SEAL_ZERO}, indent=2, allow_nan=False) + "\n"
        except (TypeError, ValueError) as e:
            raise LowbitError(
                f"manifest fields must be plain JSON (str, int, finite float, bool, None, list, dict): {e}"
            ) from None
        return _seal_text(text, _seal_of(text))

    @classmethod
    def from_dict(cls, d: Any, where: str = "manifest") -> Manifest:
        """Validate the schema and build a Manifest; any problem raises LowbitError naming `where`."""

        def bad(msg: str) -> LowbitError:
            return LowbitError(f"{where}: {msg}; the artifact is damaged or not a lowbit artifact: re-create it")

        if not isinstance(d, dict):
            raise bad("top level must be a JSON object")
        if extra := sorted(set(d) - _KEYS):
            raise bad(f"unknown top-level key {extra[0]!r}")
        if SEAL_KEY in d and (not isinstance(d[SEAL_KEY], str) or not _SHA256_RE.fullmatch(d[SEAL_KEY])):
            raise bad(f"'{SEAL_KEY}' must be 64 lowercase hex digits, got {d[SEAL_KEY]!r}")
        if d.get("format") != FORMAT:
            raise bad(f"'format' must be {FORMAT!r}, got {d.get('format')!r}")
        fv = d.get("format_version")
        if not isinstance(fv, int) or isinstance(fv, bool) or fv < 1:
            raise bad(f"'format_version' must be a positive integer, got {fv!r}")
        if fv > FORMAT_VERSION:
            raise LowbitError(
                f"{where}: format_version {fv} is newer than this lowbit reads ({FORMAT_VERSION}); upgrade lowbit"
            )
        for key in ("kind", "class"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise bad(f"'{key}' must be a non-empty string, got {d.get(key)!r}")
        if d["class"] not in ARTIFACT_CLASSES:
            raise bad(f"'class' {d['class']!r} is not one of {', '.join(ARTIFACT_CLASSES)}")
        for key in ("inputs", "recipe", "versions", "counts"):
            if not isinstance(d.get(key), dict):
                raise bad(f"'{key}' must be a JSON object, got {type(d.get(key)).__name__}")
        if not isinstance(d.get("files"), list):
            raise bad(f"'files' must be a list, got {type(d.get('files')).__name__}")
        files: list[FileEntry] = []
        seen: set[str] = set()
        for i, e in enumerate(d["files"]):
            if not isinstance(e, dict) or set(e) != {"path", "bytes", "sha256"}:
                raise bad(f"files[{i}] must be an object with exactly path, bytes, sha256")
            p, n, h = e["path"], e["bytes"], e["sha256"]
            if not isinstance(p, str) or not _is_safe_relpath(p) or p == MANIFEST_NAME:
                # Refuse absolute paths and '..' so verify never reads outside the artifact.
                raise bad(f"files[{i}].path {p!r} must be a normalized relative path inside the artifact")
            if p in seen:
                raise bad(f"files[{i}].path {p!r} is listed twice")
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise bad(f"files[{i}].bytes must be a non-negative integer, got {n!r}")
            if not isinstance(h, str) or not _SHA256_RE.fullmatch(h):
                raise bad(f"files[{i}].sha256 must be 64 lowercase hex digits, got {h!r}")
            seen.add(p)
            files.append(FileEntry(p, n, h))
        return cls(
            kind=d["kind"],
            artifact_class=d["class"],
            inputs=d["inputs"],
            recipe=d["recipe"],
            versions=d["versions"],
            counts=d["counts"],
            files=tuple(files),
            format_version=fv,
        )


def _is_safe_relpath(p: str) -> bool:
    pp = PurePosixPath(p)
    return (
        bool(p)
        and not pp.is_absolute()
        and "\\" not in p
        and str(pp) == p  # normalized: no '.', '//' or trailing '/'
        and all(part not in ("", ".", "..") for part in pp.parts)
    )


# A write is staged in a hidden sibling of its output (lowbit.artifacts.writer): what one looks like.
STAGING_RE = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)")


def staging_name(out_name: str, pid: int | None = None) -> str:
    """The hidden sibling a write to `out_name` is staged in: `.<out_name>.tmp-<pid>`."""
    return f".{out_name}.tmp-{os.getpid() if pid is None else pid}"


def is_staging_dir(path: str | os.PathLike) -> bool:
    """True for a name of the staging form (what an unfinished write looks like; never an artifact)."""
    return STAGING_RE.fullmatch(Path(path).name) is not None


def load_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and validate `directory/manifest.json`. Missing, corrupt or malformed -> LowbitError."""
    root = Path(directory)
    if not root.is_dir():
        raise LowbitError(f"artifact directory {root} does not exist or is not a directory")
    if is_staging_dir(root.resolve()):
        raise LowbitError(f"{root} is the staging directory of an unfinished (or killed) write, not an artifact; "
                          "use the finished output directory, or write it again")
    mpath = root / MANIFEST_NAME
    if not mpath.is_file():
        raise LowbitError(f"{root} has no {MANIFEST_NAME}; run `lowbit pin {root}` to record its files")
    try:
        text = mpath.read_bytes().decode("utf-8")
        d = json.loads(text)
    except OSError as e:
        raise LowbitError(f"{mpath} cannot be read ({e.strerror}); check its permissions or re-create it") from None
    except UnicodeDecodeError:
        raise LowbitError(f"{mpath} is not UTF-8 text; the artifact is damaged: re-create it") from None
    except json.JSONDecodeError as e:
        raise LowbitError(
            f"{mpath} is not valid JSON (line {e.lineno} col {e.colno}: {e.msg}); the artifact is damaged: re-create it"
        ) from None
    m = Manifest.from_dict(d, where=str(mpath))
    if SEAL_KEY in d and _seal_of(text) != d[SEAL_KEY]:
        raise LowbitError(f"{mpath} does not match its own sha256 ({SEAL_KEY}): manifest.json was changed or "
                          "damaged since it was written; re-create the artifact or copy it again")
    return replace(m, root=root)


def require_class(manifest: Manifest, expected: str) -> Manifest:
    """Return `manifest` if its class is `expected`, else raise: artifact classes are never interchangeable."""
    check_class(expected)
    if manifest.artifact_class != expected:
        where = f"artifact {manifest.root}" if manifest.root is not None else "artifact"
        raise LowbitError(
            f"{where} is class {manifest.artifact_class!r} (kind {manifest.kind!r}) but {expected!r} is required; "
            f"the classes are not interchangeable: use an artifact produced as {expected!r} "
            f"({CLASS_MEANING[expected]}; README: Checking any artifact)"
        )
    return manifest
