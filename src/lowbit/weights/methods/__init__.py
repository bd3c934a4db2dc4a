"""Weight quantization methods: one file each in this folder, found by scanning it; quantize_model runs the one named.

    from lowbit.weights import methods
    methods.get("gptq")            # a Method: name, needs_calib, layerwise, run(job)
    methods.names()                # every method this folder holds (each module registers itself on import)

A method turns the target linears of a model into QuantLinear modules by calling `job.done(name, linear,
QuantizedWeight)` for each; lowbit.weights.apply.quantize_model does the rest (checks, rotation and
smoothing before, the skipped-linear refusal and scale tuning after) and knows no method by name.
Adding a method is one new file here that calls `register(Method(...))` at import.

    needs_calib  the method reads calibration tokens (refused without them, before any work)
    layerwise    it sees linears through the decoder layers only (linears outside them are refused
                 up front instead of being skipped)
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lowbit.core.errors import LowbitError


@dataclass
class MethodJob:
    """What a method works on. options: quantize_model's method settings (damp, block, act_order, sequential,
    clip_search, weighted_clip, signround, ...): each method reads the ones it has."""

    model: Any
    layers: Any  # the decoder layers (nn.ModuleList)
    targets: dict  # name -> nn.Linear to quantize
    scheme: Any  # WeightScheme
    calib: Any  # int64 [n, T] token ids, or None
    batch_size: int
    autocast: Callable  # () -> context manager for the calibration forwards
    scale_dtype: Any
    done: Callable  # done(name, linear, QuantizedWeight): replace the linear by its QuantLinear
    report: Any  # the QuantizeReport (a method records calib_tokens and its own stats there)
    progress: bool | None = False
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    name: str
    run: Callable[[MethodJob], None]
    needs_calib: bool = False
    layerwise: bool = False
    module: str = ""


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add a method (called at import of its module); a second one under the same name is a bug."""
    old = _REGISTRY.get(method.name)
    if old is not None and old.module != method.module:
        raise LowbitError(f"two weight methods named {method.name!r} ({old.module}, {method.module})")
    _REGISTRY[method.name] = method
    return method


def all_methods() -> dict[str, Method]:
    """{name: Method} of every module of this package (imported on first use) and any registered elsewhere."""
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    return dict(_REGISTRY)


def names() -> tuple[str, ...]:
    return tuple(sorted(all_methods()))


def get(name: str) -> Method:
    """The method called `name` (LowbitError naming the known ones otherwise)."""
    found = all_methods()
    if name not in found:
        raise LowbitError(f"unknown method {name!r}; use one of {', '.join(sorted(found))}")
    return found[name]
