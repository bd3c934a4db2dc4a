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
with Hadamard, +0.13% fitted; benchmarks/results/quality/COMMANDS.md.)

On disk (lowbit.artifacts, class "generic", kind "kv-key-affine"):
    key_affine.safetensors    layers.{i}.scale, layers.{i}.shift  float32 [H_kv, D]  (mapped layers)
                              layers.{i}.rot_k [D_k, D_k], layers.{i}.rot_v [D_v, D_v]  (base "fitted": every layer)
                              metadata: model, base ("hadamard" | "none" | "fitted")
A KVScheme names it as its rotation (rotation = {path, sha256}); lowbit.kv.plan.load_rotations opens it
(the base rotation plus this map), so a recipe pins both by one sha256.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.core.errors import LowbitError

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
class KeyStats:
    """Running per-layer sums of post-RoPE K (and K^2) and Q^2 over tokens >= skip of each window."""

    def __init__(self, skip: int = 64):
        self.skip = int(skip)
        self.sk: dict[int, torch.Tensor] = {}
        self.sk2: dict[int, torch.Tensor] = {}
        self.sq2: dict[int, torch.Tensor] = {}
        self.n: dict[int, int] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling, softcap=None):
        i = int(module.layer_idx)
        B, Hkv, T, D = key.shape
        if T <= self.skip:
            return
        k = key[:, :, self.skip :].double()  # [B, Hkv, T', D]
        G = query.shape[1] // Hkv
        q = query[:, :, self.skip :].double().reshape(B, Hkv, G, T - self.skip, -1)
        if q.shape[-1] != D:
            raise LowbitError(f"layer {i}: query width {q.shape[-1]} differs from key width {D}")
        add = {"sk": k.sum((0, 2)), "sk2": k.pow(2).sum((0, 2)), "sq2": q.pow(2).sum((0, 2, 3)) / G}
        for name, t in add.items():
            d = getattr(self, name)
            d[i] = d[i] + t if i in d else t
        self.n[i] = self.n.get(i, 0) + B * (T - self.skip)
        return

    def affine(self, alpha: float = 0.5, center: bool = True) -> dict[int, KeyAffine]:
        """{layer: KeyAffine} from the sums (see the module docstring)."""
        out = {}
        for i, n in sorted(self.n.items()):
            mu = self.sk[i] / n
            var = (self.sk2[i] / n - (mu.pow(2) if center else 0)).clamp_min(0)
            sk = pair_mean(var).sqrt()
            sq = pair_mean(self.sq2[i] / n).sqrt()
            floor = 1e-6 * float(sk.max().clamp_min(1e-30))  # a dead pair keeps a finite scale
            s = sk.clamp_min(floor).pow(1 - alpha) / sq.clamp_min(1e-12).pow(alpha)
            s = s / s.log().mean(-1, keepdim=True).exp()  # geometric mean 1 per KV head
            out[i] = KeyAffine(s.float(), (mu if center else torch.zeros_like(mu)).float())
        return out


@torch.no_grad()
def fit(model, windows: torch.Tensor, *, alpha: float = 0.5, skip: int = 64, center: bool = True,
        shift_only: bool = False) -> dict[int, KeyAffine]:
    """Fit every layer's key map on calibration windows [N, L] (never the test text).

    shift_only: scale 1 (the map is k - shift): removes the keys' per-channel offset and nothing else, what a
    scale-only grid (TensorQuant zero "none", centred on 0) needs, without the pair scaling (on smollm2-135m
    the scaled map raised int2's error in 9 of 30 layers)."""
    from lowbit.calib.capture import capture_attention

    if not 0.0 <= alpha <= 1.0:
        raise LowbitError(f"alpha {alpha} is outside [0, 1] (0: equalise keys only; 0.5: balance with queries)")
    if windows.dim() != 2 or windows.shape[1] <= skip:
        raise LowbitError(f"calibration windows must be [N, L] with L > skip ({skip}), got {tuple(windows.shape)}")
    st = KeyStats(skip)
    with capture_attention(model, st):
        for w in windows:
            model(w[None], use_cache=False, logits_to_keep=1)
    if not st.n:
        raise LowbitError("no attention layer reported keys during the key-affine fit")
    if shift_only and not center:
        raise LowbitError("a shift-only key map with no shift (center off) is the identity; drop one of them")
    maps = st.affine(alpha, center)
    if shift_only:
        maps = {i: KeyAffine(torch.ones_like(m.scale), m.shift) for i, m in maps.items()}
    return maps


@torch.no_grad()
def select(model, windows: torch.Tensor, maps: dict[int, KeyAffine], geometry, *, scheme="int2",
           base: str = "hadamard") -> tuple[dict[int, KeyAffine], dict]:
    """Keep a layer's map only where it lowers that layer's attention-output error (the layer-error
    harness, `scheme` through the cache's codec) on the same calibration windows; the others keep the
    plain rotation. Returns (kept maps, {layer: (dB plain, dB mapped)})."""
    from lowbit.eval.layer_error import Variant, measure_layers
    from lowbit.kv.plan import load_rotations
    from lowbit.kv.scheme import parse_kv_scheme

    sch = parse_kv_scheme(scheme) if isinstance(scheme, str) else scheme
    rots = load_rotations(base, geometry).per_layer
    rot = {g.index: rots[g.index] for g in geometry.layers}
    db = measure_layers(model, windows, [Variant("plain", sch, rot), Variant("mapped", sch, rot, key_affine=maps)])
    evidence = {i: (db["plain"].get(i), db["mapped"].get(i)) for i in sorted(maps)}
    kept = {i: m for i, m in maps.items() if evidence[i][1] is not None and evidence[i][0] is not None
            and evidence[i][1] < evidence[i][0]}
    return kept, evidence


class MappedMoments:
    """Per-layer second moments, summed over KV heads, of the mapped post-RoPE keys and of the values over
    tokens >= skip of each window: what a "fitted" base rotation is the eigenvectors of."""

    def __init__(self, maps: dict[int, KeyAffine], skip: int = 64):
        self.maps, self.skip = maps, int(skip)
        self.kk: dict[int, torch.Tensor] = {}
        self.vv: dict[int, torch.Tensor] = {}
        self.n: dict[int, int] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling, softcap=None):
        i = int(module.layer_idx)
        if key.shape[2] <= self.skip:
            return
        k = map_keys(key[:, :, self.skip :], self.maps.get(i)).double()  # [B, Hkv, T', D_k]
        v = value[:, :, self.skip :].double()  # [B, Hkv, T', D_v]
        kk, vv = torch.einsum("bhtd,bhte->de", k, k), torch.einsum("bhtd,bhte->de", v, v)
        self.kk[i] = self.kk[i] + kk if i in self.kk else kk
        self.vv[i] = self.vv[i] + vv if i in self.vv else vv
        self.n[i] = self.n.get(i, 0) + k.shape[0] * k.shape[1] * k.shape[2]
        return

    def rotations(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{layer: (R_k [D_k, D_k], R_v [D_v, D_v])} float32, orthogonal (checked)."""
        from lowbit.rotation.fit import check_orthogonal, rotation_from_cov

        out = {}
        for i, n in sorted(self.n.items()):
            rk = rotation_from_cov(self.kk[i] / n).float().contiguous()
            rv = rotation_from_cov(self.vv[i] / n).float().contiguous()
            check_orthogonal(rk, f"layer {i} K")
            check_orthogonal(rv, f"layer {i} V")
            out[i] = (rk, rv)
        return out


@torch.no_grad()
def fit_base(model, windows: torch.Tensor, maps: dict[int, KeyAffine], geometry, *, skip: int = 64
             ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The "fitted" base rotation of every layer on calibration windows [N, L], keys mapped by `maps` first."""
    from lowbit.calib.capture import capture_attention

    for g in geometry.layers:
        if getattr(g, "storage", "mha") != "mha" or getattr(g, "shares_kv", False):
            raise LowbitError(f"layer {g.index} stores K and V once (MLA latent / K = V): a fitted key-affine base "
                              "covers plain K/V layers only; use --base hadamard, or lowbit fit-rotations")
    st = MappedMoments(maps, skip)
    with capture_attention(model, st):
        for w in windows:
            model(w[None], use_cache=False, logits_to_keep=1)
    missing = sorted({g.index for g in geometry.layers} - set(st.n))
    if missing:
        raise LowbitError(f"layers {missing} reported no keys longer than skip={skip} during the base fit; "
                          "use longer calibration windows")
    return st.rotations()


# ------------------------------------------------------------------ files
def save(out_dir, affine: dict[int, KeyAffine], *, model: str, base: str = "hadamard", inputs: dict | None = None,
         rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> Path:
    """Write the per-layer maps as a new artifact (kind "kv-key-affine"); a scheme names it as its rotation.
    rotations: {layer: (R_k, R_v)} for every layer, exactly when base is "fitted" (fit_base)."""
    from safetensors.torch import save_file

    from lowbit.artifacts import ArtifactWriter

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
    from lowbit.artifacts import load_manifest

    return load_manifest(p).kind == KIND


def load(path, geometry) -> tuple[str, dict[int, KeyAffine], str, dict | None]:
    """(base rotation, {layer: KeyAffine}, sha256 of the file, {layer: (R_k, R_v)} for base "fitted" else None),
    checked against its manifest and `geometry`."""
    from safetensors import safe_open

    from lowbit.artifacts import load_manifest, require_intact

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
    from lowbit.rotation.fit import check_orthogonal

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


# ------------------------------------------------------------------ command
def main(argv=None) -> int:
    """python -m lowbit.kv.key_affine --model M --out DIR [--calib stdlib] [--windows 2] [--seq-len 1024]:
    fit on calibration text (never the evaluation text), write the artifact, print the recipe line."""
    import argparse
    import time

    from lowbit.artifacts import load_manifest

    ap = argparse.ArgumentParser(prog="python -m lowbit.kv.key_affine", description=main.__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--calib", default="stdlib")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--skip", type=int, default=64)
    ap.add_argument("--no-center", action="store_true")
    ap.add_argument("--base", default="hadamard", choices=BASES, help="rotation after the map: hadamard (default), "
                    "none, or fitted (eigenvectors of the mapped keys' / the values' second moments x Hadamard)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-select", action="store_true", help="keep every layer's map (default: only where the "
                    "calibration layer error of int2 drops)")
    ap.add_argument("--shift-only", action="store_true", help="scale 1: the map only subtracts the keys' "
                    "calibration mean per channel (for scale-only grids, --zero none)")
    ap.add_argument("--zero", default="group", choices=("group", "none"), help="int2's zero storage when --select "
                    "measures the layer error (none: scale-only groups)")
    a = ap.parse_args(argv)
    if Path(a.out).exists():
        raise LowbitError(f"--out {a.out} exists; give a new directory")
    import lowbit.models
    from lowbit.calib.corpora import load_text, token_windows

    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    lm = lowbit.models.resolve(a.model, dtype=torch.float32)
    windows = token_windows(lm.tokenizer, load_text(a.calib), a.seq_len, a.windows)
    maps = fit(lm.model, windows, alpha=a.alpha, skip=a.skip, center=not a.no_center, shift_only=a.shift_only)
    evidence = {}
    if not a.no_select:  # measured on Hadamard when the base is fitted (its rotations depend on the kept maps)
        from lowbit.kv.scheme import parse_kv_scheme

        maps, evidence = select(lm.model, windows, maps, lm.geometry, scheme=parse_kv_scheme("int2", zero=a.zero),
                                base="hadamard" if a.base == "fitted" else a.base)
        print("layer error of int2 on the calibration windows, dB plain -> mapped (kept where lower):")
        print("  " + ", ".join(f"{i}: {p:.1f}->{m:.1f}{'*' if i in maps else ''}" for i, (p, m) in evidence.items()))
        if not maps:
            raise LowbitError(f"the key affine lowers no layer's calibration error on {lm.name}: nothing to write")
    rots = fit_base(lm.model, windows, maps, lm.geometry, skip=a.skip) if a.base == "fitted" else None
    inputs = {"weights_sha256": lm.weights_sha256, "calib": str(a.calib), "windows": a.windows, "seq_len": a.seq_len,
              "alpha": a.alpha, "skip": a.skip, "center": not a.no_center, "selected": not a.no_select,
              "shift_only": a.shift_only, "select_zero": a.zero,
              "layer_db_plain_mapped": {str(i): [round(p, 2), round(m, 2)] for i, (p, m) in evidence.items()}}
    save(a.out, maps, model=lm.name, base=a.base, inputs=inputs, rotations=rots)
    sha = load_manifest(a.out).file_map()[FILE_NAME].sha256
    print(f"fitted {len(maps)} layers of {lm.name} on {a.windows} x {a.seq_len} {a.calib} tokens in "
          f"{time.perf_counter() - t0:.0f} s -> {a.out}")
    print(f'rotation = {{ path = "{a.out}", sha256 = "{sha}" }}')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
