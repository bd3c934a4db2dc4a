"""Key equalisation: a fitted per-layer, per-KV-head affine map of the post-RoPE keys, exact for attention.

Why: some models' keys carry large per-channel offsets (Qwen2's k_proj bias: on qwen2.5-coder-0.5b the
per-channel mean is 96-99% of the key energy in layers 0, 1, 2, 8, and one channel's RMS is up to 92x the
median's). A per-token quantizer (groups over the channels of one token) then spends its 4 levels on the
offset and the outlier channels, and the part of the key that moves the softmax is lost. KIVI's
per-channel keys avoid it, but the fused decode kernel reads per-token groups. This map keeps the
per-token codec (and the kernel) and removes the offset and the spread before it:

    stored K  = ((k - shift) / scale) @ R_k       every tier (sink, middle, recent): one map at ingest
    query     = (q * scale) @ R_k                 the inverse-transpose of the key map's linear part

    q' . K' = q diag(s) R R^T diag(1/s) (k - shift) = q . k - q . shift

q . shift is the same for every key of a query, so the softmax (and the attention output) is unchanged:
exact, provided every key of the layer is stored shifted (the cache maps at ingest) and the logits are not
soft-capped or joined by a learned sink logit (refused). V is untouched. The arrays are per-layer
constants ([H_kv, D] float32 each), not per token: they add nothing to held bits per element.

scale is equal on the two channels of a RoPE pair (channel i and i + D/2, transformers' rotate_half):
RoPE turns each pair by a position's angle, so a per-pair scale commutes with it and the equalised keys
have the same statistics at every position (it could also be folded into k_proj / q_proj). It is fitted
SmoothQuant-style to balance the key's spread against the query's (alpha 0.5):
    s_p = sqrt(std_k,p / rms_q,p)   (pair p; q pooled over the query heads of the KV head)
normalised to geometric mean 1. shift is the calibration mean of the post-RoPE key per channel (a
constant: exact whatever it is; it removes the offset of the slowly-turning pairs, which is where the
bias sits). Statistics skip the first `skip` tokens of each window (the sink tier, stored exact).

Base rotation R_k / R_v: "hadamard", "none", or "fitted": per layer, the covariance eigenvectors x Hadamard
(lowbit.rotation.fit.rotation_from_cov) of the *mapped* keys' and of the values' second moments on the same
calibration windows, summed over the layer's KV heads (one [D, D] per layer, so V's rotation still folds into
the weights). Fitting K's rotation after the map matters: the map removes the offset and equalises the pairs,
which changes the key's principal directions. (qwen2.5-coder-0.5b int2, stdlib 2 x 1024 fake-quant PPL: +0.89%
with Hadamard, +0.13% fitted; docs/DESIGN_NOTES.md.)

On disk (lowbit.artifacts, class "generic", kind "kv-key-affine"):
    key_affine.safetensors    layers.{i}.scale, layers.{i}.shift  float32 [H_kv, D]  (mapped layers)
                              layers.{i}.rot_k [D_k, D_k], layers.{i}.rot_v [D_v, D_v]  (base "fitted": every layer)
                              metadata: model, base ("hadamard" | "none" | "fitted")
Fitting (statistics over calibration windows, the per-layer selection, the fitted base) is
lowbit.calib.key_affine; this module is the map itself: apply, save, load.
A KVScheme names it as its rotation (rotation = {path, sha256}); lowbit.kv.plan.load_rotations opens it
(the base rotation plus this map), so a recipe pins both by one sha256.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.artifacts import ArtifactWriter, load_manifest, require_intact
from lowbit.core.errors import LowbitError
from lowbit.rotation.fit import check_orthogonal

KIND = "kv-key-affine"
FILE_NAME = "key_affine.safetensors"
FORMAT = "lowbit-kv-key-affine"
BASES = ("hadamard", "none", "fitted")


@dataclass(frozen=True)
class KeyAffine:
    """One layer's key map: scale, shift float32 [H_kv, D] (scale > 0, equal within a RoPE pair)."""

    scale: torch.Tensor
    shift: torch.Tensor

    def __post_init__(self):
        if self.scale.shape != self.shift.shape or self.scale.dim() != 2:
            raise LowbitError(f"key affine scale {list(self.scale.shape)} and shift {list(self.shift.shape)} "
                              "must both be [H_kv, D]")
        if not bool(torch.isfinite(self.scale).all() and (self.scale > 0).all() and torch.isfinite(self.shift).all()):
            raise LowbitError("key affine scale must be finite and > 0 and shift finite; refit it")


def map_keys(k: torch.Tensor, ka: KeyAffine | None) -> torch.Tensor:
    """k [B, H_kv, T, D] -> (k - shift) / scale in float32 (None: k unchanged)."""
    if ka is None:
        return k
    s, b = ka.scale.to(k.device)[None, :, None, :], ka.shift.to(k.device)[None, :, None, :]
    return (k.float() - b) / s


def unmap_keys(k: torch.Tensor, ka: KeyAffine | None) -> torch.Tensor:
    """Inverse of map_keys (for error measurement): k * scale + shift, float32."""
    if ka is None:
        return k
    s, b = ka.scale.to(k.device)[None, :, None, :], ka.shift.to(k.device)[None, :, None, :]
    return k.float() * s + b


def map_queries(q: torch.Tensor, ka: KeyAffine | None) -> torch.Tensor:
    """q [B, H_kv, N, D] (the query heads of each KV head stacked as rows) -> q * scale, float32."""
    if ka is None:
        return q
    return q.float() * ka.scale.to(q.device)[None, :, None, :]


def pair_mean(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: each channel replaced by the mean over its RoPE pair (i, i + D/2)."""
    h = x.shape[-1] // 2
    m = (x[..., :h] + x[..., h:]) / 2
    return torch.cat([m, m], -1)


# ------------------------------------------------------------------ fit
# ------------------------------------------------------------------ files
def save(out_dir, affine: dict[int, KeyAffine], *, model: str, base: str = "hadamard", inputs: dict | None = None,
         rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> Path:
    """Write the per-layer maps as a new artifact (kind "kv-key-affine"); a scheme names it as its rotation.
    rotations: {layer: (R_k, R_v)} for every layer, exactly when base is "fitted" (fit_base)."""
    from safetensors.torch import save_file

    if base not in BASES:
        raise LowbitError(f"key affine base rotation {base!r} unknown; use one of {BASES}")
    if not affine:
        raise LowbitError("no layer maps to save")
    if (base == "fitted") != (rotations is not None):
        raise LowbitError("a key affine with base 'fitted' stores its rotations (fit_base), and only it does")
    tensors = {}
    for i, ka in sorted(affine.items()):
        tensors[f"layers.{int(i)}.scale"] = ka.scale.float().contiguous()
        tensors[f"layers.{int(i)}.shift"] = ka.shift.float().contiguous()
    for i, (rk, rv) in sorted((rotations or {}).items()):
        tensors[f"layers.{int(i)}.rot_k"] = rk.float().contiguous()
        tensors[f"layers.{int(i)}.rot_v"] = rv.float().contiguous()
    meta = {"model": model, "base": base, "format": FORMAT, "layers": json.dumps(sorted(int(i) for i in affine))}
    with ArtifactWriter(out_dir, kind=KIND, artifact_class="generic", inputs={"model": model, **(inputs or {})},
                        recipe={"format": FORMAT, "format_version": 1, "base": base}) as w:
        save_file(tensors, str(w.path / FILE_NAME), metadata=meta)
        w.counts = {"layers": len(affine)}
    return Path(out_dir)


def is_key_affine(path) -> bool:
    """Whether `path` is a key-affine artifact directory (its manifest's kind)."""
    p = Path(path)
    if not (p / "manifest.json").is_file():
        return False

    return load_manifest(p).kind == KIND


def load(path, geometry) -> tuple[str, dict[int, KeyAffine], str, dict | None]:
    """(base rotation, {layer: KeyAffine}, sha256 of the file, {layer: (R_k, R_v)} for base "fitted" else None),
    checked against its manifest and `geometry`."""
    from safetensors import safe_open

    root = Path(path)
    man = load_manifest(root)
    if man.kind != KIND:
        raise LowbitError(f"{root} is a {man.kind!r} artifact, not a key affine ({KIND!r})")
    require_intact(root, "key affine")
    sha = man.file_map()[FILE_NAME].sha256
    out: dict[int, dict] = {}
    with safe_open(str(root / FILE_NAME), framework="pt") as f:
        meta = f.metadata() or {}
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            _, i, which = key.split(".")
            out.setdefault(int(i), {})[which] = f.get_tensor(key).float()
    model, base = meta.get("model"), meta.get("base", "hadamard")
    if base not in BASES:
        raise LowbitError(f"key affine {root}: base rotation {base!r} unknown (this lowbit reads {BASES})")
    if model and geometry.name and model != geometry.name:
        raise LowbitError(f"key affine {root} was fitted for model {model!r}, not {geometry.name!r}; fit it for this model")
    maps, rots = {}, {}
    by_index = {g.index: g for g in geometry.layers}
    for i, d in sorted(out.items()):
        g = by_index.get(i)
        if g is None:
            raise LowbitError(f"key affine {root} names layer {i} but the model has layers 0..{geometry.num_layers - 1}")
        if "scale" in d:
            want = [g.num_kv_heads, g.head_dim_k]
            if list(d["scale"].shape) != want:
                raise LowbitError(f"key affine {root} layer {i} is {list(d['scale'].shape)} but the model's keys are "
                                  f"{want} (KV heads, head_dim): fitted for another model")
            maps[i] = KeyAffine(d["scale"], d["shift"])
        if "rot_k" in d:
            rots[i] = _checked_rotation(root, g, d)
    if base == "fitted":
        missing = sorted(set(by_index) - set(rots))
        if missing:
            raise LowbitError(f"key affine {root} has base 'fitted' but no rotation for layers {missing}: refit it "
                              "with --base fitted")
    elif rots:
        raise LowbitError(f"key affine {root} stores rotations but its base is {base!r}: a damaged or hand-made file; refit it")
    return base, maps, sha, (rots if base == "fitted" else None)


def _checked_rotation(root, g, d) -> tuple[torch.Tensor, torch.Tensor]:
    rk, rv = d.get("rot_k"), d.get("rot_v")
    for name, r, dim in (("K", rk, g.head_dim_k), ("V", rv, g.head_dim_v)):
        if r is None or list(r.shape) != [dim, dim]:
            raise LowbitError(f"key affine {root} layer {g.index}: {name} rotation is "
                              f"{None if r is None else list(r.shape)}, the model needs [{dim}, {dim}]: fitted for "
                              "another model")
        try:
            check_orthogonal(r, f"key affine {root} layer {g.index} {name}")
        except LowbitError as e:
            raise LowbitError(f"{e}; refit it") from None
    return rk, rv

