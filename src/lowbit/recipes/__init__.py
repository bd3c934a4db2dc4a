"""KV recipes shipped inside the package, loadable by name: `MODEL@BUDGET` (e.g. `smollm2-135m@2.5`).

    lowbit eval --model smollm2-135m --recipe smollm2-135m@2.5
    from lowbit.recipes import shipped_path, names
    shipped_path("smollm2-135m@2.5")   # the TOML's path, after its sha256 matched index.json

A recipe file is JSON or TOML (read_recipe_file: the one reader; lowbit.kv.scheme.load_recipe turns its
[kv] table into a KVScheme). Each recipe is a `lowbit tune` output (its [tune] table holds the budget, the held bits measured at
its context and the evidence), pinned by the sha256 in index.json: a file that differs from its pin
is refused by name. A recipe that names a key affine (lowbit.kv.key_affine: the gemma3 and qwen recipes; the
smollm2 ones use rotation "hadamard") ships it under keyaffine/<dir>/, named relative to the recipe and pinned
by the sha256 of its key_affine.safetensors (checked when the recipe is resolved).
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path

from lowbit.core.errors import LowbitError

RECIPES_DIR = Path(__file__).parent
INDEX_FILE = "index.json"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*@\d+(\.\d+)?$")


def read_recipe_file(path) -> dict:
    """Parse a recipe file (.json, or .toml via tomllib) into a dict."""
    p = Path(path)
    if not p.is_file():
        raise LowbitError(f"recipe file {p} not found")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix.lower() == ".toml":
            return tomllib.loads(text)
        if p.suffix.lower() == ".json":
            return json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise LowbitError(f"recipe file {p} is not valid {p.suffix[1:].upper()}: {e}") from None
    raise LowbitError(f"recipe file {p}: unknown format {p.suffix!r}; use .json or .toml")


def index() -> dict:
    """{name: {"file", "sha256", "model", "budget", "context"}} of the shipped recipes."""
    p = RECIPES_DIR / INDEX_FILE
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}


def names() -> list[str]:
    return sorted(index())


def looks_like_name(text: str) -> bool:
    """True for MODEL@BUDGET (not a path)."""
    return bool(NAME_RE.match(str(text))) and not Path(str(text)).exists()


def shipped_path(name: str) -> Path:
    """The path of shipped recipe `name`, its sha256 checked against the index. LowbitError otherwise."""
    idx = index()
    if name not in idx and "@" in name:  # smollm2-135m@3.0 is smollm2-135m@3
        model, _, budget = name.rpartition("@")
        name = f"{model}@{float(budget):g}" if f"{model}@{float(budget):g}" in idx else name
    if name not in idx:
        known = ", ".join(sorted(idx)) or "none"
        raise LowbitError(f"no shipped recipe {name!r}; shipped: {known} (or give a recipe .toml / .json path)")
    entry = idx[name]
    p = RECIPES_DIR / entry["file"]
    if not p.is_file():
        raise LowbitError(f"shipped recipe {name}: {p.name} is missing from the package; reinstall lowbit")
    sha = hashlib.sha256(p.read_bytes()).hexdigest()
    if sha != entry["sha256"]:
        raise LowbitError(f"shipped recipe {name}: {p.name} has sha256 {sha[:12]}... but the index pins "
                          f"{entry['sha256'][:12]}...; it was modified: reinstall lowbit")
    return p


def recipe_model(path) -> str | None:
    """The model a recipe file was tuned for ([tune].model), or None when it does not say."""
    d = read_recipe_file(path)
    t = d.get("tune") if isinstance(d, dict) else None
    return t.get("model") if isinstance(t, dict) else None


def write_index(directory: Path = RECIPES_DIR) -> dict:
    """(Maintainers) pin every recipe TOML in `directory` into index.json: name = file stem, its sha256,
    and the [tune] model, budget, context and held bits. Run after adding a `lowbit tune` output:
    python -c "import lowbit.recipes as r; r.write_index()"."""
    import tomllib

    out = {}
    for p in sorted(Path(directory).glob("*.toml")):
        t = tomllib.loads(p.read_text(encoding="utf-8")).get("tune", {})
        out[p.stem] = {"file": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "model": t.get("model"),
                       "budget": t.get("budget"), "context": t.get("context"), "held_bits": t.get("held_bits")}
    (Path(directory) / INDEX_FILE).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return out
