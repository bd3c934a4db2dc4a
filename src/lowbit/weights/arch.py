"""Architecture registry: where the pieces of a decoder sit, and whether the residual rotation applies.

Quantization itself is generic (every nn.Linear inside the decoder layers, minus the ignore list).
The residual-stream rotation (rotate.py) is not: it needs plain RMSNorm (y = w * x / rms(x)) in
front of every reader of the residual stream and nothing else touching it. Each architecture is
one ArchSpec entry; a model_type without an entry, or with `rotation_refusal` set, is refused
with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lowbit.core.errors import LowbitError


def set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule of `root` at dotted path `name` with `new`."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


@dataclass(frozen=True)
class ArchSpec:
    """Module paths relative to the causal-LM model (layers) or to one decoder layer (the rest)."""

    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    attn_readers: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    attn_writer: str = "self_attn.o_proj"
    v_proj: str = "self_attn.v_proj"
    mlp_readers: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    mlp_writer: str = "mlp.down_proj"
    rotation_refusal: str | None = None  # why the residual rotation cannot be folded, if it cannot
    # VLMs: the vision tower (kept unquantized by design: only the decoder is quantized) and the tower's
    # linears whose outputs enter the decoder's residual stream (image embeddings replace image tokens'
    # rows of the embedding output, so the residual rotation must rotate them as it rotates E)
    vision: str | None = None
    vision_writers: tuple[str, ...] = ()


_LLAMA = ArchSpec()
_GEMMA3 = ArchSpec(
    layers="model.layers",
    rotation_refusal=(
        "Gemma3 norms are y = (1 + w) * x / rms(x), post-attention / post-feedforward norms sit on the "
        "residual branches and the embeddings are scaled by sqrt(hidden); the residual rotation cannot "
        "be folded into its weights"
    ),
)

# Qwen2.5-VL (transformers >= 4.52 module layout, 5.17 and 5.24): a Qwen2 decoder under model.language_model,
# the tower at model.visual; its PatchMerger's last linear (mlp.2) writes the image embeddings.
_QWEN2_5_VL = ArchSpec(
    layers="model.language_model.layers", embed="model.language_model.embed_tokens",
    final_norm="model.language_model.norm", vision="model.visual", vision_writers=("model.visual.merger.mlp.2",),
)

ARCHS: dict[str, ArchSpec] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,  # q/k/v biases ride along: a rotation of the inputs leaves output biases alone
    "gemma3_text": _GEMMA3,
    "gemma3": _GEMMA3,
    "qwen2_5_vl": _QWEN2_5_VL,
}


def arch_of(model: nn.Module) -> tuple[str, ArchSpec | None]:
    """(model_type, ArchSpec or None when unregistered)."""
    mt = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    return mt, ARCHS.get(mt)


def rotation_spec(model: nn.Module) -> ArchSpec:
    """The ArchSpec of a model the residual rotation supports, else LowbitError saying why not."""
    mt, spec = arch_of(model)
    if spec is None:
        ok = sorted(k for k, v in ARCHS.items() if v.rotation_refusal is None)
        raise LowbitError(
            f"--rotate does not know architecture {mt!r} (supported: {', '.join(ok)}); quantize without --rotate"
        )
    if spec.rotation_refusal:
        raise LowbitError(f"--rotate is not supported on {mt}: {spec.rotation_refusal}; quantize without --rotate")
    return spec


def vision_tower(model: nn.Module) -> str | None:
    """Dotted path of `model`'s vision tower (registered VLMs), else None."""
    _, spec = arch_of(model)
    if spec is None or spec.vision is None:
        return None
    try:
        get_module(model, spec.vision)
    except AttributeError:
        raise LowbitError(f"{type(model).__name__}: no vision tower at {spec.vision}; this transformers version lays "
                          "the model out differently: update lowbit.weights.arch.ARCHS") from None
    return spec.vision


def default_ignore(model: nn.Module) -> list[str]:
    """The ignore list when none is given: lm_head, and a VLM's whole vision tower (as one regex, the
    compressed-tensors convention, so transformers' loader leaves the tower's linears alone too)."""
    tower = vision_tower(model)
    return ["lm_head"] + ([] if tower is None else [f"re:^{tower.replace('.', chr(92) + '.')}\\."])


def get_module(root: nn.Module, path: str) -> nn.Module:
    m = root
    for part in path.split("."):
        m = getattr(m, part)
    return m


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers: the registry path, else the only ModuleList whose
    length is config.num_hidden_layers."""
    _, spec = arch_of(model)
    if spec is not None:
        try:
            layers = get_module(model, spec.layers)
            if isinstance(layers, nn.ModuleList):
                return layers
        except AttributeError:
            pass
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    cands = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(cands) != 1:
        raise LowbitError(
            f"cannot find the decoder layers of {type(model).__name__}; add its model_type to lowbit.weights.arch.ARCHS"
        )
    return cands[0]
