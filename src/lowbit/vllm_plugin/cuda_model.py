"""The served model as lowbit's CUDA vLLM backend sees it (no vLLM import): sidecar -> scheme -> per-layer cell
formats and rotations, with every rule the CUDA kernels add to the CPU plugin's refused at load, by name."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from lowbit.core.errors import LowbitError
from lowbit.vllm_plugin import sidecar

log = logging.getLogger("lowbit.vllm_plugin")


def cuda_reason(fmt, geometry_layer) -> str | None:
    """Why the CUDA kernels cannot take a layer's cell format (None: they can)."""
    for which in ("k", "v"):
        c = fmt.codecs[which]
        W = which.upper()
        if not c.quantized:
            return f"{W} is stored at 16 bits; the CUDA backend's kernels read packed codes only"
        if c.tq.grid not in ("minmax", "std"):
            return f"{W} uses the {c.tq.grid!r} grid; the CUDA write kernel has the min/max and std grids"
        d = c.head_dim
        if d & (d - 1) or d < 16:
            return f"{W} head_dim {d} is not a power of two >= 16 (the Triton kernels' tiles)"
        if c.group & (c.group - 1):
            return f"{W} group {c.group} is not a power of two"
    if geometry_layer.attention == "sliding":
        return f"layer {geometry_layer.index} is a sliding-window layer; the CUDA backend serves full attention only"
    return None


@dataclass
class CudaModel:
    """The served model as the CUDA backend sees it: scheme, per-layer cell formats and rotations."""

    path: str
    scheme: object
    geometry: object
    layer_formats: list
    rotations: list  # [(R_k, R_v)] float32 on the CPU; moved to the device per layer once
    slot_bytes: int


@lru_cache(maxsize=4)
def load(path: str, dense_dtype: torch.dtype) -> CudaModel | None:
    """The lowbit model at `path` (None: no sidecar -- vLLM's own backends serve it). Refuses what the CUDA
    backend cannot take, naming the rule."""
    p = Path(path)
    if not sidecar.has_sidecar(p):
        return None
    from transformers import AutoConfig

    from lowbit.kv.plan import resolve
    from lowbit.models.geometry import ModelGeometry
    from lowbit.vllm_plugin.slot import layer_formats

    side = sidecar.read(p)
    geometry = ModelGeometry.from_config(AutoConfig.from_pretrained(p), name=side["model"]["name"])
    sidecar.check_against(side, geometry)
    scheme = sidecar.scheme_of(side, p)
    if scheme.page != 1:
        raise LowbitError(f"{p}: the sidecar has page {scheme.page}; the vLLM plugin packs every token on write "
                          "(page 1): export again with `lowbit export --for vllm`")
    plan = resolve(scheme, geometry, device="cpu")
    scheme = plan.scheme
    fmts = layer_formats(plan, dense_dtype)  # SlotFormat refuses VQ, residual, KIVI, Lloyd-Max, ... by name
    for lp, f in zip(plan.layers, fmts):
        why = cuda_reason(f, lp.geometry)
        if why is None and getattr(lp, "k_affine", None) is not None:
            why = f"layer {lp.index} has a key affine; the CUDA backend does not map keys"
        if why:
            raise LowbitError(f"lowbit plugin (CUDA): {p.name}: {why}; serve it with `lowbit serve` or export "
                              "another recipe")
    sizes = {f.slot_bytes for f in fmts}
    if len(sizes) != 1:
        raise LowbitError(f"lowbit plugin (CUDA): layers with different head dims ({sorted(sizes)} B cells) are "
                          "not supported")
    rots = [(lp.rot_k, lp.rot_v) for lp in plan.layers]
    log.warning("lowbit plugin (CUDA): %s KV %s: %s", p.name, scheme.describe(), fmts[0].describe())
    return CudaModel(path=str(p), scheme=scheme, geometry=geometry, layer_formats=fmts, rotations=rots,
                     slot_bytes=fmts[0].slot_bytes)
