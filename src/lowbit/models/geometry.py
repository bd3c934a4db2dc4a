"""Per-layer attention geometry of a model, read from its Hugging Face config.

The KV cache, the rotations and the kernels size everything from this: which layers are
full / sliding (and the window), how many query and KV heads, and the K and V head dims.
Only what the library supports is accepted; anything else is refused by name, so a new
architecture fails loudly instead of being cached with the wrong shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lowbit.core.errors import LowbitError
from lowbit.models.registry import BUILTINS, get_builtin

# HF layer_types value -> our attention kind
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


@dataclass(frozen=True)
class LayerGeometry:
    """Attention geometry of one decoder layer.

    window: number of most recent tokens a sliding layer attends to (HF `sliding_window`);
            None for full layers.
    storage: how K/V are held per token: "mha" = per KV head, K [Hkv, head_dim_k] and
            V [Hkv, head_dim_v] (covers MHA, GQA and MQA, and MLA run expanded: DeepseekV3 as
            MHA with K 192 / V 128); "mla-latent" = one shared latent per token (MLA absorbed:
            num_kv_heads 1, V = c_kv [latent_dim], K = [c_kv | k_pe] [latent_dim + rope_dim]).
    k_eq_v: K and V come from one projection (Gemma-4 `attention_k_eq_v` full layers): the cache
            stores V once plus K's RoPE dims (`rope_dim` of them) and rebuilds K from them.
    kv_shared_from: the layer that produces this layer's K/V (Gemma-4 `num_kv_shared_layers`
            consumers store nothing); None = the layer stores its own.
    latent_dim: MLA kv_lora_rank (mla-latent only). rope_dim: width of K's RoPE part that is
            stored apart from V (mla-latent: qk_rope_head_dim; k_eq_v: the rotated dims).
    """

    index: int
    attention: str  # "full" | "sliding"
    window: int | None
    num_q_heads: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    storage: str = "mha"
    k_eq_v: bool = False
    kv_shared_from: int | None = None
    latent_dim: int | None = None
    rope_dim: int | None = None

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def shares_kv(self) -> bool:
        """K is rebuilt from the stored V plus K's own part (mla-latent, or k_eq_v)."""
        return self.storage == "mla-latent" or self.k_eq_v

    def k_own_dims(self) -> list[int]:
        """The K dims stored apart from V when `shares_kv` (the rest of K is derived from V):
        mla-latent: [latent_dim, latent_dim + rope_dim) (k_pe after c_kv); k_eq_v: the RoPE'd dims,
        the first rope_dim/2 of each half (transformers' rotate_half pairs i with i + D/2)."""
        if self.storage == "mla-latent":
            return list(range(self.latent_dim, self.latent_dim + self.rope_dim))
        if self.k_eq_v:
            a, half = (self.rope_dim or 0) // 2, self.head_dim_k // 2
            return list(range(a)) + list(range(half, half + a))
        return []

    @property
    def group_key(self) -> tuple:
        """What makes two layers the same geometry group (one codec/rotation shape for all of them)."""
        return (self.storage, self.num_kv_heads, self.head_dim_k, self.head_dim_v, self.k_eq_v)


@dataclass(frozen=True)
class ModelGeometry:
    """Geometry of every decoder layer, in order. `layers[i].index == i`."""

    name: str
    model_type: str
    layers: list[LayerGeometry] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def full_layers(self) -> list[int]:
        return [g.index for g in self.layers if g.attention == "full"]

    @property
    def sliding_layers(self) -> list[int]:
        return [g.index for g in self.layers if g.attention == "sliding"]

    @classmethod
    def from_config(cls, config: Any, name: str | None = None, *, mla: str = "latent") -> ModelGeometry:
        """Build from a transformers PretrainedConfig or its to_dict().

        Multimodal configs use their text config. Reads num_attention_heads,
        num_key_value_heads (default: = q heads), head_dim (default: hidden_size // heads),
        layer_types and sliding_window. Without layer_types, a set sliding_window (and
        use_sliding_window not False) means every layer slides (Mistral-style).
        Per-layer geometry: Gemma-4 full layers take `per_layer_config` (transformers 5.24) or
        global_head_dim / num_global_key_value_heads (the hub config's keys), attention_k_eq_v
        and num_kv_shared_layers. MLA (DeepseekV3, kv_lora_rank): mla="latent" caches the shared
        latent (storage "mla-latent"), mla="expanded" caches per-head K (nope + rope) / V (MHA).
        """
        if mla not in ("latent", "expanded"):
            raise LowbitError(f"mla={mla!r}: use 'latent' (cache c_kv + k_pe) or 'expanded' (cache per-head K/V)")
        cfg = _as_text_dict(config)
        model_type = str(cfg.get("model_type") or "unknown")
        if name is None:
            name = str(cfg.get("_name_or_path") or model_type)
        _refuse_unsupported(cfg, model_type)
        if cfg.get("kv_lora_rank"):
            return cls(name=name, model_type=model_type, layers=_mla_layers(cfg, model_type, mla))

        n_layers = _require_int(cfg, "num_hidden_layers", model_type)
        n_q = _require_int(cfg, "num_attention_heads", model_type)
        n_kv = cfg.get("num_key_value_heads") or n_q
        if n_q % n_kv:
            raise LowbitError(
                f"{model_type}: {n_q} query heads are not a multiple of {n_kv} KV heads; fix the config"
            )
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            hidden = _require_int(cfg, "hidden_size", model_type)
            if hidden % n_q:
                raise LowbitError(
                    f"{model_type}: hidden_size {hidden} is not divisible by {n_q} heads and the "
                    "config has no head_dim; add head_dim to the config"
                )
            head_dim = hidden // n_q
        window = cfg.get("sliding_window")

        kinds = _layer_kinds(cfg, n_layers, window, model_type)
        if "sliding" in kinds and not window:
            raise LowbitError(f"{model_type}: config has sliding layers but no sliding_window; fix the config")
        layers = []
        shared = _kv_shared_from(cfg, kinds, model_type)
        for i, kind in enumerate(kinds):
            dk, hkv, k_eq_v, rope = _layer_overrides(cfg, i, kind, int(head_dim), int(n_kv))
            if n_q % hkv:
                raise LowbitError(f"{model_type} layer {i}: {n_q} query heads are not a multiple of {hkv} KV heads")
            layers.append(LayerGeometry(
                index=i,
                attention=kind,
                window=int(window) if kind == "sliding" else None,
                num_q_heads=int(n_q),
                num_kv_heads=hkv,
                head_dim_k=dk,
                head_dim_v=dk,
                k_eq_v=k_eq_v,
                kv_shared_from=shared[i],
                rope_dim=rope,
            ))
        return cls(name=name, model_type=model_type, layers=layers)

    def groups(self) -> dict[tuple, list[int]]:
        """{LayerGeometry.group_key: layer indices}: the geometry groups, in first-seen order."""
        out: dict[tuple, list[int]] = {}
        for g in self.layers:
            out.setdefault(g.group_key, []).append(g.index)
        return out

    def to_dict(self) -> dict:
        """JSON-ready form (for manifests and reports)."""
        return {"name": self.name, "model_type": self.model_type, "layers": [asdict(g) for g in self.layers]}

    @classmethod
    def from_dict(cls, d: dict) -> ModelGeometry:
        return cls(name=d["name"], model_type=d["model_type"], layers=[LayerGeometry(**g) for g in d["layers"]])

    def attention_summary(self) -> str:
        """e.g. '15 sliding (window 512) + 3 full' or '30 full'."""
        n_full, n_slide = len(self.full_layers), len(self.sliding_layers)
        windows = sorted({g.window for g in self.layers if g.window is not None})
        parts = []
        if n_slide:
            parts.append(f"{n_slide} sliding (window {'/'.join(map(str, windows))})")
        if n_full:
            parts.append(f"{n_full} full")
        return " + ".join(parts) if parts else "no layers"

    def heads_summary(self) -> str:
        """e.g. '4 q / 1 kv heads, head_dim 256' (per-layer variants joined with '|')."""
        variants = sorted({(g.num_q_heads, g.num_kv_heads, g.head_dim_k, g.head_dim_v) for g in self.layers})
        out = []
        for q, kv, dk, dv in variants:
            dims = f"head_dim {dk}" if dk == dv else f"head_dim k {dk} / v {dv}"
            out.append(f"{q} q / {kv} kv heads, {dims}")
        return " | ".join(out)

    def summary(self) -> str:
        """One line for the CLI: name, layers, heads, head_dim, attention pattern."""
        return f"{self.name}: {self.num_layers} layers, {self.heads_summary()}, {self.attention_summary()}"

    def layer_lines(self) -> list[str]:
        """One line per run of identical consecutive layers, e.g. 'layers 0-4: sliding w512, 4q/1kv, d256'."""
        lines, start = [], 0
        for i in range(1, self.num_layers + 1):
            if i < self.num_layers and _key(self.layers[i]) == _key(self.layers[start]):
                continue
            g = self.layers[start]
            span = f"layer {start}" if i - 1 == start else f"layers {start}-{i - 1}"
            kind = f"sliding w{g.window}" if g.attention == "sliding" else "full"
            dims = f"d{g.head_dim_k}" if g.head_dim_k == g.head_dim_v else f"dk{g.head_dim_k}/dv{g.head_dim_v}"
            extra = (", k=v" if g.k_eq_v else "") + (f", kv from {g.kv_shared_from}" if g.kv_shared_from is not None else "")
            lines.append(f"{span}: {kind}, {g.num_q_heads}q/{g.num_kv_heads}kv, {dims}, {g.storage}{extra}")
            start = i
        return lines


def _key(g: LayerGeometry) -> tuple:
    return (g.attention, g.window, g.num_q_heads, g.num_kv_heads, g.head_dim_k, g.head_dim_v, g.storage, g.k_eq_v,
            g.kv_shared_from)


def _as_text_dict(config: Any) -> dict:
    """A plain dict of the (text) decoder config."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if hasattr(config, "to_dict"):
        d = config.to_dict()
        # to_dict() drops model_type on some nested configs; the class knows it
        d.setdefault("model_type", getattr(config, "model_type", None))
        return d
    if isinstance(config, dict):
        text = config.get("text_config")
        return dict(text) if isinstance(text, dict) else dict(config)
    raise LowbitError(f"cannot read a model geometry from a {type(config).__name__}; pass a transformers config")


def _require_int(cfg: dict, key: str, model_type: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or v <= 0:
        raise LowbitError(f"{model_type}: config has no usable {key} ({v!r}); this architecture is not supported")
    return v


def _refuse_unsupported(cfg: dict, model_type: str) -> None:
    """Attention variants whose K/V the library cannot hold yet, named so users know why."""
    if cfg.get("kv_lora_rank") and model_type not in MLA_MODEL_TYPES:
        raise LowbitError(
            f"{model_type}: multi-head latent attention (kv_lora_rank={cfg['kv_lora_rank']}) is supported for "
            f"{', '.join(MLA_MODEL_TYPES)} only (lowbit's MLA attention is written for that module)"
        )
    if cfg.get("attention_chunk_size") and "layer_types" not in cfg:
        raise LowbitError(f"{model_type}: chunked attention (attention_chunk_size) is not supported")


MLA_MODEL_TYPES = ("deepseek_v3",)


def _mla_layers(cfg: dict, model_type: str, mla: str) -> list[LayerGeometry]:
    """DeepseekV3 layers (all full attention). latent: MQA over [c_kv | k_pe] with V = c_kv;
    expanded: per head K = [k_nope | k_pe] (qk_nope + qk_rope) and V (v_head_dim)."""
    n_layers = _require_int(cfg, "num_hidden_layers", model_type)
    n_q = _require_int(cfg, "num_attention_heads", model_type)
    rank = _require_int(cfg, "kv_lora_rank", model_type)
    rope = _require_int(cfg, "qk_rope_head_dim", model_type)
    nope = _require_int(cfg, "qk_nope_head_dim", model_type)
    dv = _require_int(cfg, "v_head_dim", model_type)
    if mla == "latent":
        kw = dict(num_kv_heads=1, head_dim_k=rank + rope, head_dim_v=rank, storage="mla-latent",
                  latent_dim=rank, rope_dim=rope)
    else:
        kw = dict(num_kv_heads=n_q, head_dim_k=nope + rope, head_dim_v=dv, rope_dim=rope)
    return [LayerGeometry(index=i, attention="full", window=None, num_q_heads=n_q, **kw) for i in range(n_layers)]


def _layer_overrides(cfg: dict, i: int, kind: str, head_dim: int, n_kv: int) -> tuple[int, int, bool, int | None]:
    """(head_dim, kv heads, k_eq_v, rope_dim of a k_eq_v layer) of layer i: Gemma-4's full layers differ
    from the config's top-level values. transformers 5.24 writes `per_layer_config` {"i": {...}}; the hub
    config (and older transformers) name global_head_dim / num_global_key_value_heads instead."""
    per = cfg.get("per_layer_config") or {}
    # keys are layer indices as strings, zero-padded to the widest ("05") in 5.24's to_dict()
    per = {int(k): v for k, v in per.items() if str(k).isdigit()} if isinstance(per, dict) else {}
    over = per.get(i)
    dk, hkv = head_dim, n_kv
    k_eq_v = bool(cfg.get("attention_k_eq_v")) and kind == "full"
    if isinstance(over, dict):
        dk = int(over.get("head_dim", dk))
        hkv = int(over.get("num_key_value_heads", hkv))
    elif kind == "full" and not per:
        dk = int(cfg.get("global_head_dim") or dk)
        if k_eq_v and cfg.get("num_global_key_value_heads"):
            hkv = int(cfg["num_global_key_value_heads"])
    rope = None
    if k_eq_v:
        rp = cfg.get("rope_parameters") or {}
        rp = rp.get("full_attention", rp) if isinstance(rp, dict) else {}
        frac = float(rp.get("partial_rotary_factor", 1.0)) if isinstance(rp, dict) else 1.0
        rope = 2 * int(frac * dk // 2)
    return dk, hkv, k_eq_v, rope


def _kv_shared_from(cfg: dict, kinds: list[str], model_type: str) -> list[int | None]:
    """Per layer, the layer whose K/V it reuses (Gemma-4 num_kv_shared_layers: the last n layers reuse the
    last earlier layer of their attention kind), else None."""
    n = len(kinds)
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    out: list[int | None] = [None] * n
    if shared <= 0:
        return out
    first = n - shared
    for i in range(first, n):
        src = [j for j in range(first) if kinds[j] == kinds[i]]
        if not src:
            raise LowbitError(f"{model_type}: layer {i} shares K/V but no earlier {kinds[i]} layer produces them")
        out[i] = src[-1]
    return out


def _layer_kinds(cfg: dict, n_layers: int, window: Any, model_type: str) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        slides = bool(window) and cfg.get("use_sliding_window", True) is not False
        return ["sliding" if slides else "full"] * n_layers
    if len(types) != n_layers:
        raise LowbitError(
            f"{model_type}: layer_types has {len(types)} entries but num_hidden_layers is {n_layers}; fix the config"
        )
    unknown = sorted({t for t in types if t not in _LAYER_TYPES})
    if unknown:
        raise LowbitError(
            f"{model_type}: attention type(s) {', '.join(unknown)} not supported "
            f"(supported: {', '.join(_LAYER_TYPES)})"
        )
    return [_LAYER_TYPES[t] for t in types]


def geometry_of(name_or_dir) -> ModelGeometry:
    """A model's geometry from its config alone (no weights): a built-in's stored config, or
    DIR/config.json. The name is what resolve() calls the model (what RotationSets are checked against)."""
    import json
    import os
    from pathlib import Path

    key = os.fspath(name_or_dir)
    if key in BUILTINS:
        return ModelGeometry.from_config(BUILTINS[key].config_dict(), name=key)
    p = Path(key).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise LowbitError(f"{p} has no config.json: pass a Hugging Face model directory or a built-in name")
        try:
            d = json.loads(cfg.read_text())
        except ValueError as e:
            raise LowbitError(f"{cfg} is not valid JSON ({e})") from None
        return ModelGeometry.from_config(d, name=p.resolve().name)
    get_builtin(key)  # raises: unknown model, lists the built-ins
    raise LowbitError(f"model {key!r} not found")
