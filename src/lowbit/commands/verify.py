"""`lowbit verify DIR`: check DIR against its manifest.json, one `path: STATUS` line per file like `sha256sum -c`."""

from __future__ import annotations

NAME = "verify"
HELP = "check every file of an artifact against its manifest (OK/FAILED/MISSING/UNLISTED); exit 1 on any problem"


def add_arguments(parser) -> None:
    parser.add_argument("dir", metavar="DIR", help="artifact directory containing manifest.json")


def run(args) -> int:
    from pathlib import Path

    from lowbit.artifacts.verify import FAILED, MISSING, OK, UNLISTED, verify
    from lowbit.artifacts.writer import sweep_stale

    d = Path(args.dir)
    sweep_stale(d.resolve().parent)  # killed writers' staging dirs beside it (one stderr line each)
    if d.is_dir() and not (d / "manifest.json").exists():
        sweep_stale(d)  # DIR is a parent of artifacts, not one (an artifact is never modified)
    results = verify(args.dir)
    for path, status in results:
        print(f"{path}: {status}")
    n = {s: sum(r.status == s for r in results) for s in (OK, FAILED, MISSING, UNLISTED)}
    if n[OK] == len(results):
        print(f"verify: {args.dir}: all {n[OK]} files OK")
        return 0
    print(
        f"verify: {args.dir}: {n[FAILED]} failed, {n[MISSING]} missing, {n[UNLISTED]} unlisted "
        f"({n[OK]} of {len(results) - n[UNLISTED]} listed files OK)"
    )
    return 1
