"""Resolve a KV recipe once into a per-layer Plan: the one place that opens rotation and levels files.

    from lowbit.kv.plan import resolve
    plan = resolve(scheme, geometry, device="cuda")      # checks everything, opens each file once
    cache = QuantizedKVCache.from_plan(model, plan)      # free: no file, no check repeated
    print(plan.table())

Plan (frozen) holds, per layer (LayerPlan): the attention kind and window, the layer's scheme (its
layer_bits override applied), the K and V codecs (bits, group, grid, axis, Lloyd-Max levels: the
ONE quantizer, lowbit.kv.codec.TensorCodec), the rotations (float32 tensors, loaded and verified
once; None = identity) and, per step kind, the backend chosen and why (the rules: lowbit.kv.capabilities; who runs a step: lowbit.backends). The
plan's `scheme` is the input scheme with its RotationRef / LevelsRef pinned to the sha256 of what
was opened, so a manifest that records `plan.scheme.to_dict()` names exactly what was served.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from lowbit.artifacts import ArtifactWriter, load_manifest, require_intact
from lowbit.core.errors import LowbitError
from lowbit.kv import capabilities, key_affine
from lowbit.kv.codec import TensorCodec
from lowbit.kv.scheme import KVScheme, LevelsRef, RotationRef, TensorQuant, parse_kv_scheme
from lowbit.rotation.hadamard import hadamard, is_supported_order
from lowbit.rotation.rotation_set import FILE_NAME, RotationSet

DECODE_CHOICES = ("auto", "torch", "triton")
_REQUESTED = {"torch": "torch-stream", "triton": "triton-decode"}
LEVELS_KIND = "kv-levels"
LEVELS_FILE = "levels.safetensors"


@dataclass(frozen=True)
class BackendChoice:
    """The backend a step kind of a layer runs on, and why that one."""

    name: str
    reason: str


@dataclass(frozen=True)
class LayerPlan:
    """Everything one layer's cache needs, resolved. k / v: TensorCodec; rot_k / rot_v: None, [D, D]
    or [Hkv, D, D] float32 on CPU; backends: {step kind: BackendChoice}."""

    geometry: object  # lowbit.models.geometry.LayerGeometry
    scheme: KVScheme
    k: TensorCodec
    v: TensorCodec
    rot_k: torch.Tensor | None
    rot_v: torch.Tensor | None
    rotation: str
    backends: dict = field(default_factory=dict)
    # lowbit.kv.key_affine.KeyAffine or None: keys stored as ((k - shift) / scale) @ R_k, queries as
    # (q * scale) @ R_k (exact for attention; every reader of the tiers applies it with the rotation)
    k_affine: object = None

    @property
    def index(self) -> int:
        return self.geometry.index

    @property
    def window(self) -> int | None:
        return self.geometry.window if self.geometry.attention == "sliding" else None

    @property
    def sink(self) -> int:
        return self.scheme.sink

    @property
    def recent(self) -> int:
        return self.scheme.recent

    @property
    def page(self) -> int:
        return self.scheme.page


@dataclass(frozen=True)
class Plan:
    """A KV recipe resolved against one model's geometry on one device kind ("cpu" | "cuda")."""

    scheme: KVScheme
    geometry: object  # lowbit.models.geometry.ModelGeometry
    device: str
    decode_backend: str
    layers: tuple
    rotation_sha256: str | None = None
    levels_sha256: str | None = None

    def layer(self, index: int) -> LayerPlan:
        return self.layers[index]

    def backend_names(self, step: str) -> set[str]:
        return {lp.backends[step].name for lp in self.layers if step in lp.backends}

    def to_dict(self) -> dict:
        """JSON-ready: the pinned scheme and per layer what was chosen (no tensors)."""
        rows = []
        for lp in self.layers:
            g = lp.geometry
            rows.append({
                "layer": lp.index, "attention": g.attention, "window": lp.window,
                "kv_heads": g.num_kv_heads, "head_dim_k": g.head_dim_k, "head_dim_v": g.head_dim_v,
                "storage": getattr(g, "storage", "mha"), "k_eq_v": bool(getattr(g, "k_eq_v", False)),
                "k": _codec_doc(lp.k), "v": _codec_doc(lp.v), "rotation": lp.rotation,
                "backends": {s: {"name": c.name, "reason": c.reason} for s, c in lp.backends.items()},
            })
        return {"scheme": self.scheme.to_dict(), "model": self.geometry.name, "device": self.device,
                "decode_backend": self.decode_backend, "rotation_sha256": self.rotation_sha256,
                "levels_sha256": self.levels_sha256, "layers": rows}

    def table(self) -> str:
        """Per layer: window, K/V bits + grid, rotation, decode backend and why (one line each)."""
        head = f"{self.geometry.name}: {self.scheme.describe()} | device {self.device}, decode {self.decode_backend}"
        cols = ("layer", "attn", "window", "K", "V", "rotation", "decode", "why")
        rows = []
        for lp in self.layers:
            dec = lp.backends.get("decode")
            rows.append((str(lp.index), lp.geometry.attention, str(lp.window or "-"), _codec_label(lp.k),
                         _codec_label(lp.v), lp.rotation, dec.name if dec else "-", dec.reason if dec else ""))
        width = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols[:-1])]
        lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols[:-1], width)) + "  " + cols[-1]]
        lines += ["  ".join(x.ljust(w) for x, w in zip(r[:-1], width)) + "  " + r[-1] for r in rows]
        return "\n".join(lines)


def _codec_label(c: TensorCodec) -> str:
    if not c.quantized:
        return "bf16"
    t = c.tq
    if t.vq is not None:
        return f"int{t.bits} vq {t.vq}" + ("" if c.scale_format == "fp16" else f" {c.scale_format}")
    grid = "lloyd-max" if t.lloyd_max else t.grid
    axis = f"ch/{c.page}" if t.axis == "channel" else f"g{c.group}"
    return (f"int{t.bits} {axis} {grid}" + ("" if c.stores_zero else " s-only")
            + ("" if c.scale_format == "fp16" else f" {c.scale_format}"))


def _codec_doc(c: TensorCodec) -> dict:
    return {"bits": c.bits, "container_bits": c.cbits, "group": c.group, "axis": c.tq.axis,
            "grid": "lloyd-max" if c.tq.lloyd_max else c.tq.grid, "symmetric": c.tq.symmetric, "clip": c.tq.clip,
            "zero": c.tq.zero if c.quantized else None,
            "levels": None if c.levels is None else [round(float(x), 6) for x in c.levels]}


# ------------------------------------------------------------------ rotations
@dataclass(frozen=True)
class Rotations:
    """What a scheme's rotation resolves to: per layer (R_k, R_v) and a label; sha256 when fitted."""

    per_layer: tuple
    label: tuple
    sha256: str | None
    per_head: bool = False
    key_affine: tuple = ()  # per layer lowbit.kv.key_affine.KeyAffine or None (empty: none anywhere)


def load_rotations(rotation, geometry) -> Rotations:
    """'none' | 'hadamard' | RotationRef -> Rotations for every layer of `geometry` (checked against it).

    The only code that opens a RotationSet for the KV cache (the plan, and the layer-error harness
    through it). A RotationRef whose sha256 differs from the file's is refused."""
    layers = list(geometry.layers)
    if rotation == "none":
        return Rotations(tuple((None, None) for _ in layers), tuple("none" for _ in layers), None)
    if rotation == "hadamard":
        mats: dict[int, torch.Tensor] = {}
        for g in layers:
            for d in (g.head_dim_k, g.head_dim_v):
                if not is_supported_order(d):
                    raise LowbitError(
                        f"layer {g.index}: no Hadamard matrix of order {d}; use rotation 'none' or a fitted RotationSet"
                    )
                if d not in mats:
                    mats[d] = hadamard(d)
        return Rotations(tuple((mats[g.head_dim_k], mats[g.head_dim_v]) for g in layers),
                         tuple("hadamard" for _ in layers), None)
    if not isinstance(rotation, RotationRef):
        raise LowbitError(f"rotation {rotation!r} is not 'none', 'hadamard' or a RotationRef")

    if key_affine.is_key_affine(rotation.path):
        return _load_key_affine(rotation, geometry)
    rs = RotationSet.load(rotation.path)  # verifies the file against its manifest
    sha = load_manifest(rotation.path).file_map()[FILE_NAME].sha256
    _check_latent_rotation(rs, layers)
    if rotation.sha256 is not None and rotation.sha256 != sha:
        raise LowbitError(
            f"rotation {rotation.path} has sha256 {sha[:12]}... but the recipe pins {rotation.sha256[:12]}...: "
            "it is another rotation set; point the recipe at the pinned one or re-pin it"
        )
    rs.validate_against(geometry)
    kind = "per-head" if rs.per_head else "per-layer"
    label = f"{kind} {sha[:8]}"
    return Rotations(tuple((rs.k[g.index].float(), rs.v[g.index].float()) for g in layers),
                     tuple(label for _ in layers), sha, per_head=rs.per_head)


def _load_key_affine(rotation: RotationRef, geometry) -> Rotations:
    """A key-affine artifact (lowbit.kv.key_affine): its base rotation plus the per-layer key maps."""
    base_name, maps, sha, fitted = key_affine.load(rotation.path, geometry)
    if rotation.sha256 is not None and rotation.sha256 != sha:
        raise LowbitError(
            f"key affine {rotation.path} has sha256 {sha[:12]}... but the recipe pins {rotation.sha256[:12]}...: "
            "it is another fit; point the recipe at the pinned one or re-pin it"
        )
    for g in geometry.layers:
        if g.index in maps and (getattr(g, "storage", "mha") != "mha" or getattr(g, "shares_kv", False)):
            raise LowbitError(f"layer {g.index} stores K and V once (MLA latent / K = V): a key affine does not "
                              "apply to it; fit the key affine without that layer")
    if base_name == "fitted":  # the artifact's own per-layer rotations, pinned by the same sha256
        per_layer = tuple(fitted[g.index] for g in geometry.layers)
        base_label = tuple(f"fitted {sha[:8]}" for _ in geometry.layers)
    else:
        base = load_rotations(base_name, geometry)
        per_layer, base_label = base.per_layer, base.label
    label = tuple(f"{lab}+key-affine {sha[:8]}" if g.index in maps else lab
                  for lab, g in zip(base_label, geometry.layers))
    return Rotations(per_layer, label, sha, per_head=False,
                     key_affine=tuple(maps.get(g.index) for g in geometry.layers))


def _check_latent_rotation(rs, layers) -> None:
    """An MLA latent has one head and one width (kv_lora_rank): refuse a per-head set or another rank by name."""
    for g in layers:
        if getattr(g, "storage", "mha") != "mla-latent":
            continue
        if rs.per_head:
            raise LowbitError(f"layer {g.index} caches an MLA latent, which is one head shared by all "
                              f"{g.num_q_heads} query heads: a per-KV-head rotation set does not apply; fit a "
                              "per-layer (v1) rotation of the latent")
        if g.index < rs.num_layers:
            d = rs.layer_info(g.index)["head_dim_v"]
            if d != g.latent_dim:
                raise LowbitError(f"rotation layer {g.index} is {d} wide but this model's MLA latent has "
                                  f"kv_lora_rank {g.latent_dim}: the set was fitted for another model; fit it on "
                                  "this model's latent")


# ------------------------------------------------------------------ levels
def save_levels(out_dir, levels: dict, *, model: str, inputs: dict | None = None) -> Path:
    """Write per-layer fitted codebooks {layer: {"k": t, "v": t}} as a new artifact (kind "kv-levels"): Lloyd-Max
    levels [2**bits], or VQ codebooks [H_kv, E, SUB] (lowbit.calib.vq); a KVScheme names it with
    LevelsRef(path, sha256)."""
    from safetensors.torch import save_file

    tensors = {}
    for i, d in sorted(levels.items()):
        for which, t in d.items():
            if which not in ("k", "v"):
                raise LowbitError(f"levels of layer {i}: key {which!r} is not 'k' or 'v'")
            if t is not None:
                t = torch.as_tensor(t, dtype=torch.float32)
                tensors[f"layers.{int(i)}.{which}"] = (t if t.dim() == 3 else t.flatten()).contiguous()
    if not tensors:
        raise LowbitError("no levels to save: every layer's K and V levels are None")
    with ArtifactWriter(out_dir, kind=LEVELS_KIND, artifact_class="generic", inputs={"model": model, **(inputs or {})},
                        recipe={"format": "lowbit-kv-levels", "format_version": 1}) as w:
        save_file(tensors, str(w.path / LEVELS_FILE), metadata={"model": model})
        w.counts = {"tensors": len(tensors)}
    return Path(out_dir)


def load_levels(ref: LevelsRef, geometry) -> tuple[dict, str]:
    """({layer: {"k"|"v": float32 [n]}}, sha256) from a levels artifact, verified against its manifest."""
    from safetensors import safe_open

    root = Path(ref.path)
    fpath = root / LEVELS_FILE
    if not fpath.is_file():
        raise LowbitError(f"levels {root}: {LEVELS_FILE} not found; write levels with lowbit.kv.plan.save_levels")
    man = load_manifest(root)
    if man.kind != LEVELS_KIND:
        raise LowbitError(f"{root} is a {man.kind!r} artifact, not Lloyd-Max levels ({LEVELS_KIND!r})")

    require_intact(root, "levels")  # every file, each named when it differs: the manifest's digest is the file's
    sha = man.file_map()[LEVELS_FILE].sha256
    if ref.sha256 is not None and ref.sha256 != sha:
        raise LowbitError(f"levels {root} has sha256 {sha[:12]}... but the recipe pins {ref.sha256[:12]}...; "
                          "point the recipe at the pinned levels or re-pin it")
    out: dict = {}
    with safe_open(str(fpath), framework="pt") as f:
        model = (f.metadata() or {}).get("model")
        if model and geometry.name and model != geometry.name:
            raise LowbitError(f"levels {root} were fitted for model {model!r}, not {geometry.name!r}; fit levels for this model")
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            _, i, which = key.split(".")
            out.setdefault(int(i), {})[which] = f.get_tensor(key).float()
    n = geometry.num_layers
    bad = [i for i in out if not 0 <= i < n]
    if bad:
        raise LowbitError(f"levels {root} name layer(s) {bad} but the model has layers 0..{n - 1}")
    return out, sha


# ------------------------------------------------------------------ resolve
def _codec(tq, head_dim: int, page: int, fitted, where: str) -> TensorCodec:
    if tq.quantized and tq.vq is not None:
        if fitted is None:
            raise LowbitError(f"{where} is vector-quantized (vq {tq.vq}) but the recipe's levels name no codebooks for "
                              "it; fit them with `lowbit calibrate --vq-for RECIPE` and name them in `levels`")
        try:
            return TensorCodec(tq, head_dim, page, fitted)
        except LowbitError as e:
            raise LowbitError(f"{where}: {e}") from None
    if fitted is not None and fitted.dim() == 3:
        fitted = None  # VQ codebooks of a tensor this layer stores on a scalar grid (a layer_bits override)
    if fitted is not None:
        if not tq.lloyd_max:
            raise LowbitError(f"{where}: the levels file has levels but this tensor is not Lloyd-Max; "
                              "drop them from the file or use --lloyd-max")
        if fitted.numel() != 1 << tq.bits:
            raise LowbitError(f"{where}: the levels file holds {fitted.numel()} levels but the tensor is stored at "
                              f"{tq.bits} bits (needs {1 << tq.bits}); fit levels for this bit width")
    return TensorCodec(tq, head_dim, page, fitted)


def _choose(lp: LayerPlan, requested: str, device: str) -> dict:
    out = {"prefill": BackendChoice("torch-stream", "prefill chunks stream over the tiers (the only prefill path)")}
    if requested == "torch":
        out["decode"] = BackendChoice("torch-stream", "requested (decode_backend='torch')")
        return out
    why = capabilities.supports(lp, "decode", device)
    if requested == "triton":
        if why:
            raise LowbitError(f"decode backend 'triton' cannot take layer {lp.index}: {why}; "
                              "use decode_backend 'auto' or 'torch'")
        out["decode"] = BackendChoice("triton-decode", "requested (decode_backend='triton')"
                                      + (" on CPU: the Triton interpreter" if device == "cpu" else ""))
    elif device != "cuda":
        out["decode"] = BackendChoice("torch-stream", f"device {device} (the fused kernel is for CUDA; "
                                      "decode_backend='triton' runs it in the Triton interpreter)")
    elif why:
        out["decode"] = BackendChoice("torch-stream", why)
    else:
        out["decode"] = BackendChoice("triton-decode", f"the fused kernel takes this layer ({capabilities.kernel_name(lp)})")
    return out


def resolve(scheme: KVScheme | str, geometry, *, device: str = "cpu", decode_backend: str = "auto") -> Plan:
    """Check `scheme` against `geometry`, open its rotation / levels files once, pick backends.

    device: "cpu" | "cuda" (where the cache will live; decides what decode_backend "auto" picks).
    decode_backend: "auto" (the kernel on CUDA where it takes the layer, else the torch path, with
    the reason) | "torch" | "triton" (every layer on the kernel, else an error naming the rule).
    """
    if isinstance(scheme, str):
        scheme = parse_kv_scheme(scheme)
    if not isinstance(scheme, KVScheme):
        raise LowbitError(f"scheme must be a KVScheme or a scheme string, got {type(scheme).__name__}")
    if decode_backend not in DECODE_CHOICES:
        raise LowbitError(f"decode backend {decode_backend!r} unknown; use one of {DECODE_CHOICES}")
    device = str(device).split(":")[0]
    if device not in ("cpu", "cuda"):
        raise LowbitError(f"device {device!r}: the KV cache runs on 'cpu' or 'cuda'")
    scheme.validate(geometry)
    shared = [g.index for g in geometry.layers if getattr(g, "kv_shared_from", None) is not None]
    if shared:
        raise LowbitError(f"layers {shared[0]}..{shared[-1]} reuse earlier layers' K/V (num_kv_shared_layers): the "
                          "lowbit cache does not serve shared-KV layers yet")
    rots = load_rotations(scheme.rotation, geometry)
    if scheme.fold_v_rotation and rots.per_head:
        raise LowbitError(
            f"rotation {scheme.rotation} is per KV head (format v2); folding V's rotation into the weights "
            "needs one rotation per layer: drop fold_v_rotation or use a per-layer (v1) rotation"
        )
    fitted, levels_sha = ({}, None)
    if scheme.levels is not None:
        fitted, levels_sha = load_levels(scheme.levels, geometry)
    pinned = scheme
    if isinstance(scheme.rotation, RotationRef) and scheme.rotation.sha256 is None:
        pinned = replace(pinned, rotation=RotationRef(scheme.rotation.path, rots.sha256))
    if scheme.levels is not None and scheme.levels.sha256 is None:
        pinned = replace(pinned, levels=LevelsRef(scheme.levels.path, levels_sha))
    layers = []
    for g in geometry.layers:
        ls = scheme.for_layer(g.index)
        lv = fitted.get(g.index, {})
        rk, rv = rots.per_layer[g.index]
        if getattr(g, "shares_kv", False):
            # V (the latent / K = V tensor) holds the layer's codes; K keeps only its own RoPE part, dense,
            # and is rebuilt from V by the layer, so K takes no rotation of its own
            k = TensorCodec(TensorQuant(bits=16), len(g.k_own_dims()), ls.page)
            rk = None
        else:
            k = _codec(ls.k, g.head_dim_k, ls.page, lv.get("k"), f"layer {g.index} K")
        v = _codec(ls.v, g.head_dim_v, ls.page, lv.get("v"), f"layer {g.index} V")
        if scheme.fold_v_rotation:
            rv = None  # V arrives rotated from the folded weights; the output needs no un-rotation
        ka = rots.key_affine[g.index] if rots.key_affine else None
        lp = LayerPlan(g, ls, k, v, rk, rv, rots.label[g.index] + (" (V folded)" if scheme.fold_v_rotation else ""),
                       k_affine=ka)
        layers.append(replace(lp, backends=_choose(lp, decode_backend, device)))
    return Plan(pinned, geometry, device, decode_backend, tuple(layers), rots.sha256, levels_sha)
