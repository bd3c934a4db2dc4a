"""The registry of KV attention backends: who can run which step of which layer, and why not.

A backend registers once, in its own module, with the capability rules it has and nothing else:

    torch-stream    lowbit.backends.torch_stream    online softmax over streamed tiers (prefill + decode): the reference
    triton-decode   lowbit.backends.triton_decode   fused split-K decode kernels (rules: lowbit.kv.capabilities)
    vllm-slot       lowbit.vllm_plugin.slot         one packed cell per (token, KV head) in vLLM's paged cache
    fake-quant      lowbit.eval.layer_error         teacher-forced evaluation on dequantized K/V (no cache)

Every module of this package is a backend and is found by scanning the package (`all_backends`): a new
backend is one new file here. A backend that belongs to a higher layer (the vLLM integration, the
evaluation harness) registers when its own module is imported; whoever asks for it by name imports
that module first, so the import shows in the graph.

`supports(layer, step, device) -> None | reason` answers for one LayerPlan (lowbit.kv.plan) and a step
kind (STEPS); the plan records the answer per layer, so the cache, the export and the vLLM plugin ask
the plan (or this registry) instead of restating a rule. `run` is the backend's entry point for that
step (its signature is the backend module's; the registry only carries it).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from lowbit.core.errors import LowbitError

STEPS = ("prefill", "decode", "paged", "fake-quant")


@dataclass(frozen=True)
class Backend:
    """name; steps it can run; supports(layer, step, device) -> None | reason; run (see the module)."""

    name: str
    steps: tuple[str, ...]
    supports: Callable
    run: Callable | None = None
    module: str = ""

    def why_not(self, layer, step: str, device: str) -> str | None:
        """None when this backend can run `step` of `layer` on `device`, else the rule that stops it."""
        if step not in self.steps:
            return f"{self.name} does not run {step} steps (it runs {', '.join(self.steps)})"
        return self.supports(layer, step, device)


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add a backend (called at import of its module); a second one under the same name is a bug."""
    old = _REGISTRY.get(backend.name)
    if old is not None and old.module != backend.module:
        raise LowbitError(f"two KV backends named {backend.name!r} ({old.module}, {backend.module})")
    _REGISTRY[backend.name] = backend
    return backend


def all_backends() -> dict[str, Backend]:
    """{name: Backend} of every backend registered: each module of this package (imported here on first
    use), plus those of higher layers whose modules were imported (vllm-slot, fake-quant)."""
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    return dict(_REGISTRY)


def get(name: str) -> Backend:
    """The backend called `name` (LowbitError naming the known ones otherwise)."""
    found = all_backends()
    if name not in found:
        raise LowbitError(f"KV backend {name!r} unknown; known: {', '.join(sorted(found))}")
    return found[name]


def supporting(layer, step: str, device: str) -> dict[str, str | None]:
    """{backend name: None (supports) | reason} for every backend that runs `step`."""
    if step not in STEPS:
        raise LowbitError(f"step kind {step!r} unknown; use one of {', '.join(STEPS)}")
    return {n: b.why_not(layer, step, device) for n, b in sorted(all_backends().items()) if step in b.steps}
