"""RotationSet: the per-layer (or per-KV-head) orthogonal rotations the KV cache applies to K and V.

On disk a rotation set is an artifact directory (lowbit.artifacts, class "generic",
kind "kv-rotations"):

    manifest.json            inputs (model, ...), recipe (format, format_version), files + sha256
    rotations.safetensors    layers.{i}.k, layers.{i}.v   float32
                               format v1: [D, D]          one rotation per layer
                               format v2: [H_kv, D, D]    one rotation per KV head
                             metadata (strings): format, format_version, model, num_layers,
                               layers = JSON [{"head_dim_k", "head_dim_v", "num_kv_heads"}, ...]

Stored K is k @ R_k (every tier), q is rotated by the same R_k, stored V is v @ R_v and the
attention output is multiplied by R_v^T: R must be orthogonal (checked at load).
`validate_against(geometry)` refuses a set made for another model (name, layers, KV heads, dims).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.artifacts import ArtifactWriter, load_manifest, require_intact
from lowbit.core.errors import LowbitError

FORMAT = "lowbit-rotations"
FORMAT_VERSIONS = (1, 2)
FILE_NAME = "rotations.safetensors"
ARTIFACT_KIND = "kv-rotations"
_ORTHO_TOL = 1e-3


@dataclass(frozen=True)
class RotationSet:
    """k[i], v[i]: float32 [D, D] (v1) or [H_kv, D, D] (v2) for layer i; model: the model it was fitted for."""

    model: str
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    def __post_init__(self):
        k, v = tuple(self.k), tuple(self.v)
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "v", v)
        if not k or len(k) != len(v):
            raise LowbitError(f"rotation set needs one K and one V rotation per layer, got {len(k)} K / {len(v)} V")
        nd = {t.dim() for t in k + v}
        if nd not in ({2}, {3}):
            raise LowbitError("rotations must all be [D, D] (per layer) or all [H_kv, D, D] (per KV head)")
        for i, (rk, rv) in enumerate(zip(k, v)):
            for which, r in (("k", rk), ("v", rv)):
                if r.shape[-1] != r.shape[-2]:
                    raise LowbitError(f"layers.{i}.{which} is {list(r.shape)}, not square in its last two dims")
            if rk.dim() == 3 and rk.shape[0] != rv.shape[0]:
                raise LowbitError(f"layer {i}: K has {rk.shape[0]} KV-head rotations but V has {rv.shape[0]}")

    # ------------------------------------------------------------------ shape
    @property
    def per_head(self) -> bool:
        return self.k[0].dim() == 3

    @property
    def format_version(self) -> int:
        return 2 if self.per_head else 1

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def layer_info(self, i: int) -> dict:
        rk, rv = self.k[i], self.v[i]
        return {
            "head_dim_k": int(rk.shape[-1]),
            "head_dim_v": int(rv.shape[-1]),
            "num_kv_heads": int(rk.shape[0]) if rk.dim() == 3 else None,
        }

    def check_orthogonal(self, tol: float = _ORTHO_TOL) -> None:
        """Raise unless every R satisfies |R R^T - I|_max <= tol (a non-orthogonal R changes attention)."""
        for i in range(self.num_layers):
            for which, r in (("k", self.k[i]), ("v", self.v[i])):
                r64 = r.detach().to(torch.float64)
                eye = torch.eye(r64.shape[-1], dtype=torch.float64)
                err = float((r64 @ r64.transpose(-1, -2) - eye).abs().max())
                if not err <= tol:
                    raise LowbitError(
                        f"rotation layers.{i}.{which} is not orthogonal (max |R R^T - I| = {err:.2e} > {tol:g}); "
                        "refit the rotation set"
                    )

    def validate_against(self, geometry) -> RotationSet:
        """Raise LowbitError unless this set fits `geometry` (lowbit.models.ModelGeometry): same
        model name, same number of layers, per layer the same K/V head dims and (v2) KV heads."""
        gname = getattr(geometry, "name", None)
        if self.model and gname and self.model != gname:
            raise LowbitError(
                f"rotation set was fitted for model {self.model!r}, not {gname!r}; fit rotations for this model"
            )
        if self.num_layers != geometry.num_layers:
            raise LowbitError(
                f"rotation set has {self.num_layers} layers but model {gname!r} has {geometry.num_layers}; "
                "fit rotations for this model"
            )
        for g in geometry.layers:
            info = self.layer_info(g.index)
            if info["head_dim_k"] != g.head_dim_k or info["head_dim_v"] != g.head_dim_v:
                raise LowbitError(
                    f"rotation layer {g.index} is for head_dim K {info['head_dim_k']} / V {info['head_dim_v']} but the "
                    f"model's layer {g.index} has K {g.head_dim_k} / V {g.head_dim_v}; fit rotations for this model"
                )
            if self.per_head and info["num_kv_heads"] != g.num_kv_heads:
                raise LowbitError(
                    f"rotation layer {g.index} has {info['num_kv_heads']} KV-head rotations but the model's layer "
                    f"{g.index} has {g.num_kv_heads} KV heads; fit rotations for this model"
                )
        return self

    # --------------------------------------------------------------------- io
    def _metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "format_version": str(self.format_version),
            "model": self.model,
            "num_layers": str(self.num_layers),
            "layers": json.dumps([self.layer_info(i) for i in range(self.num_layers)]),
        }

    def save(self, out_dir: str | os.PathLike, *, inputs: dict | None = None, counts: dict | None = None) -> Path:
        """Write the set as a new artifact directory `out_dir` (refused if it exists). Returns its path.

        inputs: provenance recorded in the manifest (model weights sha, calibration corpus, ...).
        """
        from safetensors.torch import save_file

        self.check_orthogonal()
        tensors = {}
        for i in range(self.num_layers):
            tensors[f"layers.{i}.k"] = self.k[i].detach().to("cpu", torch.float32).contiguous()
            tensors[f"layers.{i}.v"] = self.v[i].detach().to("cpu", torch.float32).contiguous()
        recipe = {"format": FORMAT, "format_version": self.format_version}
        with ArtifactWriter(
            out_dir,
            kind=ARTIFACT_KIND,
            artifact_class="generic",
            inputs={"model": self.model, **(inputs or {})},
            recipe=recipe,
        ) as w:
            save_file(tensors, str(w.path / FILE_NAME), metadata=self._metadata())
            w.counts = {"layers": self.num_layers, "per_head": self.per_head, **(counts or {})}
        return Path(out_dir)

    @classmethod
    def load(cls, path: str | os.PathLike, *, verify: bool = True) -> RotationSet:
        """Read a set written by `save`; with verify, the file's sha256 must match the manifest."""
        from safetensors import safe_open

        root = Path(path)
        if not root.is_dir():
            raise LowbitError(f"rotation set {root} not found (expected a directory holding {FILE_NAME})")
        fpath = root / FILE_NAME
        if not fpath.is_file():
            raise LowbitError(f"{root} is not a rotation set: {FILE_NAME} is missing")
        manifest = load_manifest(root)
        if manifest.kind != ARTIFACT_KIND:
            raise LowbitError(f"{root} is a {manifest.kind!r} artifact, not a rotation set ({ARTIFACT_KIND!r})")
        if verify:  # every file (a changed, missing or added one is named), not only the rotations

            require_intact(root, "rotation set")
        with safe_open(str(fpath), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise LowbitError(f"{fpath} is not a lowbit rotation file (format {meta.get('format')!r})")
            try:
                version = int(meta.get("format_version", "0"))
                n = int(meta["num_layers"])
            except (KeyError, ValueError):
                raise LowbitError(f"{fpath}: metadata lacks format_version / num_layers; rewrite it with save()") from None
            if version not in FORMAT_VERSIONS:
                raise LowbitError(f"{fpath}: rotation format v{version} unsupported (this lowbit reads {FORMAT_VERSIONS})")
            names = set(f.keys())
            missing = [f"layers.{i}.{w}" for i in range(n) for w in "kv" if f"layers.{i}.{w}" not in names]
            if missing:
                raise LowbitError(f"{fpath} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
            k = [f.get_tensor(f"layers.{i}.k").float() for i in range(n)]
            v = [f.get_tensor(f"layers.{i}.v").float() for i in range(n)]
        rs = cls(model=meta.get("model", ""), k=tuple(k), v=tuple(v))
        if rs.format_version != version:
            raise LowbitError(f"{fpath}: metadata says format v{version} but the tensors are v{rs.format_version}")
        rs.check_orthogonal()
        return rs
