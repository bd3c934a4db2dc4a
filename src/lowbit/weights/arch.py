"""Architecture registry: where the pieces of a decoder sit, and whether the residual rotation applies.

Quantization itself is generic (every nn.Linear inside the decoder layers, minus the ignore list).
The residual-stream rotation (rotate.py) is not: it needs plain RMSNorm (y = w * x / rms(x)) in
front of every reader of the residual stream and nothing else touching it. Each architecture is
one ArchSpec, declared by its family (lowbit.models.families/<family>.py); a model_type without one,
or with `rotation_refusal` set, is refused with that reason.
"""

from __future__ import annotations

from torch import nn

from lowbit.core.errors import LowbitError
from lowbit.models import families
from lowbit.models.families import ArchSpec


def set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule of `root` at dotted path `name` with `new`."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


# model_type -> ArchSpec, from the family registry (lowbit.models.families: one file per family)
ARCHS: dict[str, ArchSpec] = families.by_model_type("arch")


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
                          "the model out differently: update its ArchSpec in lowbit.models.families") from None
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
            f"cannot find the decoder layers of {type(model).__name__}; add its family to lowbit.models.families"
        )
    return cands[0]
