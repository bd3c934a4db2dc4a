"""Per-layer attention geometry of a model, read from its Hugging Face config.

The KV cache, the rotations and the kernels size everything from this: which layers are
full / sliding (and the window), how many query and KV heads, and the K and V head dims.
Only what the library supports is accepted; anything else is refused by name, so a new
architecture fails loudly instead of being cached with the wrong shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lowbit.errors import LowbitError

# HF layer_types value -> our attention kind
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


@dataclass(frozen=True)
class LayerGeometry:
    """Attention geometry of one decoder layer.

    window: number of most recent tokens a sliding layer attends to (HF `sliding_window`);
            None for full layers.
    storage: how K/V are held per token: "mha" = per KV head, K [Hkv, head_dim_k] and
            V [Hkv, head_dim_v] (covers MHA, GQA and MQA).
    """

    index: int
    attention: str  # "full" | "sliding"
    window: int | None
    num_q_heads: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    storage: str = "mha"

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads


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
    def from_config(cls, config: Any, name: str | None = None) -> ModelGeometry:
        """Build from a transformers PretrainedConfig or its to_dict().

        Multimodal configs use their text config. Reads num_attention_heads,
        num_key_value_heads (default: = q heads), head_dim (default: hidden_size // heads),
        layer_types and sliding_window. Without layer_types, a set sliding_window (and
        use_sliding_window not False) means every layer slides (Mistral-style).
        """
        cfg = _as_text_dict(config)
        model_type = str(cfg.get("model_type") or "unknown")
        if name is None:
            name = str(cfg.get("_name_or_path") or model_type)
        _refuse_unsupported(cfg, model_type)

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
        layers = [
            LayerGeometry(
                index=i,
                attention=kind,
                window=int(window) if kind == "sliding" else None,
                num_q_heads=int(n_q),
                num_kv_heads=int(n_kv),
                head_dim_k=int(head_dim),
                head_dim_v=int(head_dim),
            )
            for i, kind in enumerate(kinds)
        ]
        return cls(name=name, model_type=model_type, layers=layers)

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
            lines.append(f"{span}: {kind}, {g.num_q_heads}q/{g.num_kv_heads}kv, {dims}, {g.storage}")
            start = i
        return lines


def _key(g: LayerGeometry) -> tuple:
    return (g.attention, g.window, g.num_q_heads, g.num_kv_heads, g.head_dim_k, g.head_dim_v, g.storage)


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
    if cfg.get("kv_lora_rank"):
        raise LowbitError(
            f"{model_type}: multi-head latent attention (kv_lora_rank={cfg['kv_lora_rank']}) is not supported yet"
        )
    if cfg.get("attention_chunk_size") and "layer_types" not in cfg:
        raise LowbitError(f"{model_type}: chunked attention (attention_chunk_size) is not supported")


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

    from lowbit.errors import LowbitError
    from lowbit.models.registry import BUILTINS, get_builtin

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
