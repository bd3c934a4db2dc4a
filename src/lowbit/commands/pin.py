"""`lowbit pin DIR`: write manifest.json (files with bytes + sha256) for a directory of existing files."""

from __future__ import annotations

from lowbit.artifacts.manifest import ARTIFACT_CLASSES

NAME = "pin"
HELP = "record every file of DIR (bytes + sha256) in DIR/manifest.json; refuses if already pinned"


def add_arguments(parser) -> None:
    parser.add_argument("dir", metavar="DIR", help="directory of files to pin")
    parser.add_argument("--kind", default="files", help="what the artifact is, e.g. rotation-set (default: files)")
    parser.add_argument(
        "--class",
        dest="artifact_class",
        default="generic",
        choices=ARTIFACT_CLASSES,
        help="artifact class; fake-quant-eval and native-packed are never interchangeable (default: generic)",
    )


def run(args) -> int:
    from lowbit.artifacts.writer import pin

    m = pin(args.dir, kind=args.kind, artifact_class=args.artifact_class)
    print(f"pinned {len(m.files)} files ({m.total_bytes} bytes) in {args.dir} (kind {m.kind}, class {m.artifact_class})")
    return 0
