"""The lowbit KV sidecar: `lowbit_kv.json` in a model directory, saying how its KV cache is held.

Written by `lowbit export --for vllm`, read by the vLLM plugin and by `lowbit serve`. Fields:

    format, format_version    "lowbit-kv-sidecar", 1
    kv_scheme                 KVScheme.to_dict(); rotation is "none", "hadamard", or a directory
                              relative to the model directory (the exported RotationSet, "rotations")
    resolved                  per tensor (k, v): bits, container_bits, group actually used, axis,
                              bits_per_element; sink, recent, page
    geometry                  ModelGeometry.to_dict() of the model it was exported for
    model                     name, weights sha256 (of the source model)

`check_against(sidecar, geometry)` refuses a sidecar made for another model: layer count,
attention kinds, KV heads, query heads or head dims that differ are each named.
Nothing here imports vLLM or transformers: the plugin loads this before it touches vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

from lowbit.core.errors import LowbitError

SIDECAR_NAME = "lowbit_kv.json"
FORMAT = "lowbit-kv-sidecar"
FORMAT_VERSION = 1
ROTATION_DIR = "rotations"


def build(scheme, geometry, *, model_name: str, weights_sha256: str | None, rotation_rel: str | None) -> dict:
    """Sidecar dict for `scheme` (a KVScheme) on `geometry`. rotation_rel: the exported RotationSet
    directory relative to the model directory, when the scheme's rotation is a RotationSet."""
    from dataclasses import replace

    from lowbit.kv.scheme import RotationRef

    rot = scheme.rotation
    if rot not in ("none", "hadamard"):
        if rotation_rel is None:
            raise LowbitError(f"scheme rotation {rot} is a RotationSet: export it into the model directory first")
        scheme = replace(scheme, rotation=RotationRef(rotation_rel, rot.sha256))  # relative, still pinned
    dims = sorted({g.head_dim_k for g in geometry.layers} | {g.head_dim_v for g in geometry.layers})
    resolved = {}
    for which, t in (("k", scheme.k), ("v", scheme.v)):
        resolved[which] = {
            "bits": t.bits,
            "container_bits": t.container_bits if t.quantized else 16,
            "axis": t.axis,
            "group": {str(d): t.group_for(d, scheme.page) for d in dims} if t.quantized else None,
            "bits_per_element": {str(d): t.bits_per_element(d, scheme.page) for d in dims},
        }
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kv_scheme": scheme.to_dict(),
        "resolved": {**resolved, "sink": scheme.sink, "recent": scheme.recent, "page": scheme.page},
        "geometry": geometry.to_dict(),
        "model": {"name": model_name, "weights_sha256": weights_sha256},
    }


def write(directory: Path, sidecar: dict) -> Path:
    p = Path(directory) / SIDECAR_NAME
    p.write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
    return p


def has_sidecar(directory) -> bool:
    return (Path(directory) / SIDECAR_NAME).is_file()


def read(directory) -> dict:
    """The sidecar dict of a model directory (format checked)."""
    p = Path(directory) / SIDECAR_NAME
    if not p.is_file():
        raise LowbitError(f"{directory} has no {SIDECAR_NAME}: export the model with `lowbit export --for vllm`")
    try:
        d = json.loads(p.read_text())
    except ValueError as e:
        raise LowbitError(f"{p} is not valid JSON ({e}); export the model again") from None
    if not isinstance(d, dict):
        raise LowbitError(f"{p} is not a lowbit KV sidecar (a JSON {type(d).__name__}, not an object); export again")
    if d.get("format") != FORMAT:
        raise LowbitError(f"{p} is not a lowbit KV sidecar (format {d.get('format')!r})")
    if d.get("format_version") != FORMAT_VERSION:
        raise LowbitError(
            f"{p} has sidecar format v{d.get('format_version')}; this lowbit reads v{FORMAT_VERSION}: export again"
        )
    for key in ("kv_scheme", "geometry"):
        if not isinstance(d.get(key), dict):
            raise LowbitError(f"{p} lacks '{key}'; export the model again")
    return d


def scheme_of(d: dict, directory):
    """The KVScheme a sidecar describes; a relative rotation directory is resolved against `directory`."""
    from lowbit.kv.scheme import kv_scheme_from_dict

    ks = dict(d["kv_scheme"])
    # to_dict() form -> the recipe-file form kv_scheme_from_dict reads
    k, v = ks.pop("k"), ks.pop("v")
    form = {"scheme": ks.pop("name"), "sink": ks["sink"], "recent": ks["recent"], "page": ks["page"],
            "rotation": ks["rotation"], "fold_v_rotation": ks.get("fold_v_rotation", False),
            "k": k, "v": v, "version": ks.get("version", 1)}
    if ks.get("layer_bits"):  # per-layer bits: the plugin encodes each layer with its own (padded cells)
        form["layer_bits"] = [tuple(x) for x in ks["layer_bits"]]
    return kv_scheme_from_dict(form, base_dir=Path(directory))


def check_against(d: dict, geometry) -> None:
    """Refuse a sidecar whose geometry differs from the model's (names what differs)."""
    side = d["geometry"]["layers"]
    real = geometry.layers
    if len(side) != len(real):
        raise LowbitError(
            f"the KV sidecar was made for {len(side)} layers but the model has {len(real)}: export again for this model"
        )
    for s, g in zip(side, real):
        for key in ("attention", "window", "num_q_heads", "num_kv_heads", "head_dim_k", "head_dim_v"):
            if s.get(key) != getattr(g, key):
                raise LowbitError(
                    f"the KV sidecar does not match the model at layer {g.index}: {key} is {s.get(key)} in the "
                    f"sidecar but {getattr(g, key)} in the model; export again for this model"
                )
