"""What an evaluation will run, resolved from user input before any model work.

    --kv   a comma list; each item is a scheme name (bf16, int8, int4, int3, int2, kXvY, kivi2, kivi4),
           optionally with a per-item rotation `NAME@hadamard` / `NAME@none` / `NAME@PATH`, or the path of
           a recipe file (.json / .toml). The shared KV flags (--group, --sink, ...) apply to every
           scheme name; a recipe file carries its own fields.
           `bf16` is the reference: transformers DynamicCache, nothing quantized. It always runs first
           (KL, top-1 and ΔPPL are measured against it) whether or not it is listed.
           `k16v16` runs lowbit's own cache with nothing quantized (its exactness, next to bf16).
    --peers a comma list of lowbit.eval.peers.PEERS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lowbit.core.errors import LowbitError
from lowbit.eval.peers import PEERS, REFERENCE
from lowbit.kv.scheme import load_recipe, parse_kv_scheme
from lowbit.models import model_name
from lowbit.recipes import looks_like_name, recipe_model, shipped_path


@dataclass(frozen=True)
class PlannedScheme:
    """label: the row name; scheme: a lowbit KVScheme, or None for the bf16 reference."""

    label: str
    scheme: object | None


def split_list(text: str | None, what: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']; duplicates refused."""
    if text is None:
        return []
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    dup = sorted({t for t in items if items.count(t) > 1})
    if dup:
        raise LowbitError(f"{what} lists {', '.join(dup)} more than once; list each once")
    return items


def plan_schemes(kv_text: str | None, flags: dict | None = None, recipe: str | None = None,
                 model: str | None = None) -> list[PlannedScheme]:
    """Parse --kv into schemes; the bf16 reference comes first (added when not listed).

    flags: keyword arguments for lowbit.kv.scheme.parse_kv_scheme (group, sink, recent, clip, lloyd_max,
    rotation, page, symmetric, layer_bits, grid), applied to every scheme name. recipe: a --recipe file, one more row
    (named by the file's stem), or a recipe shipped in the package by name (MODEL@BUDGET, row named so; also
    accepted as a --kv item). model: the --model, against which a recipe's [tune] model is checked.
    Unknown names raise LowbitError.
    """
    def recipe_row(label: str, p: Path) -> PlannedScheme:
        tuned_for = recipe_model(p)
        if model is not None and tuned_for is not None and tuned_for != _model_name(model):
            raise LowbitError(f"recipe {label} was tuned for {tuned_for}, not {_model_name(model)}; "
                              f"use a recipe of {_model_name(model)} (its layer bits are per layer of that model)")
        return PlannedScheme(label, load_recipe(p))

    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    out = [PlannedScheme(REFERENCE, None)]
    for item in split_list(kv_text, "--kv"):
        if item.lower() == REFERENCE:
            continue
        if item.lower().endswith((".json", ".toml")):
            p = Path(item)
            if not p.is_file():
                raise LowbitError(f"--kv {item}: recipe file not found")
            out.append(recipe_row(p.stem, p))
            continue
        name, _, rot = item.partition("@")
        if rot and looks_like_name(item) and name.lower() not in _SCHEME_WORDS:
            out.append(recipe_row(item, shipped_path(item)))
            continue
        f = dict(flags)
        if rot:
            if rot not in ("none", "hadamard") and not Path(rot).is_dir():
                raise LowbitError(f"--kv {item}: rotation {rot!r} is not none, hadamard or a RotationSet directory")
            f["rotation"] = rot
        try:
            scheme = parse_kv_scheme(name, **f)
        except TypeError as e:  # a flag this parse_kv_scheme does not take
            raise LowbitError(f"--kv {item}: {e}") from None
        out.append(PlannedScheme(item, scheme))
    if recipe:
        p = Path(recipe)
        if looks_like_name(recipe):
            out.append(recipe_row(recipe, shipped_path(recipe)))
        elif not p.is_file():
            raise LowbitError(f"--recipe {recipe}: file not found")
        else:
            out.append(recipe_row(p.stem, p))
    labels = [p.label for p in out]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise LowbitError(f"--kv gives the row name(s) {', '.join(dup)} twice; list each scheme once")
    return out


_SCHEME_WORDS = ("bf16", "int8", "int4", "int3", "int2", "kivi2", "kivi4")


def _model_name(model: str) -> str:
    return model_name(model)


def plan_peers(peers_text: str | None) -> list[str]:
    """Parse --peers; unknown names raise LowbitError listing the known ones."""
    peers = split_list(peers_text, "--peers")
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise LowbitError(f"unknown peer(s) {', '.join(bad)}; known peers: {', '.join(PEERS)}")
    return peers
