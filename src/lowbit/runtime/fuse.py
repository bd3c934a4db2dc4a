"""One GEMM for the projections of a decoder layer that share their input: q/k/v and gate/up.

    handle = fuse_projections(model)   # in place; handle.groups: how many groups were fused
    ...                                # the model's own forward (and ModelStep) now runs 2 GEMMs fewer per layer
    handle.undo()                      # the original nn.Linear modules back (their weights are views of the fused one)

Why: at decode the batch is 1-64 rows, so a projection is a weight read; k_proj and v_proj of a GQA
model are small (4096 x 1024 on Llama-3-8B) and cuBLAS reads them far below the copy rate, and every
GEMM is one or two more kernels in the captured step (each a launch gap). One [Nq + Nk + Nv, K]
GEMM reads the same bytes at the rate of the large ones.

How, keeping transformers' attention and MLP code: the first module of a group (q_proj, gate_proj) is
replaced by a FusedHead that runs the one GEMM and keeps the other parts' slices for this call; the
others (k_proj, v_proj, up_proj) by FusedTail modules that return their slice. That relies on the
order transformers' Llama / Mistral / Qwen2 / Qwen3 / Gemma3 attention and MLP call them in (q, k, v;
gate, up) on the same input; a tail called without its head's pending output raises. Fused: plain
nn.Linear groups with one dtype/device and all-or-no biases, and QuantLinear groups of one scheme not
yet packed for the GPU kernels (fuse before `prepare_cuda`: the packed fused layer is one wide W4/W8
GEMM); packed or mixed groups are skipped and named.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lowbit.core.errors import LowbitError
from lowbit.weights.qlinear import QuantLinear

GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


class _Pending:
    """The slices of one head call, until the group's last tail has taken its own."""

    def __init__(self, n: int):
        self.parts: tuple | None = None
        self.n = n


class FusedHead(nn.Module):
    """x [..., K] -> the first part [..., N0]; keeps parts 1.. of linear(x) for the tails.

    linear: the group's one projection [K -> sum(sizes)] (an nn.Linear, or an unpacked QuantLinear), a
    submodule, so a later pass that packs or quantizes linears (prepare_cuda, RTN) sees one wide layer."""

    def __init__(self, linear: nn.Module, sizes: list[int], pending: _Pending):
        super().__init__()
        self.linear = linear
        self.sizes, self.pending = list(sizes), pending
        self.in_features, self.out_features = linear.in_features, sizes[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # [..., sum(sizes)]
        parts = y.split(self.sizes, dim=-1)
        self.pending.parts = parts
        return parts[0]


class FusedTail(nn.Module):
    """x -> part `index` of its head's last call (x itself is the head's input, not read again)."""

    def __init__(self, index: int, in_features: int, out_features: int, pending: _Pending):
        super().__init__()
        self.index, self.pending = index, pending
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.pending.parts
        if parts is None:
            raise LowbitError("a fused projection was called before its group's first one (q_proj / gate_proj); "
                              "undo the fusion (handle.undo()) for a model that calls them in another order")
        if self.index == self.pending.n - 1:
            self.pending.parts = None  # the last part taken: hold no activation between calls
        return parts[self.index]


@dataclass
class FusedProjections:
    """What fuse_projections did; undo() puts the original nn.Linear modules back (QuantLinear groups stay
    fused: their originals are not kept, so the unpacked codes can be freed when the fused one is packed)."""

    groups: int = 0
    skipped: list[str] = field(default_factory=list)
    _undo: list = field(default_factory=list, repr=False)

    def undo(self) -> None:
        for owner, names, mods in reversed(self._undo):
            for n, m in zip(names, mods):
                setattr(owner, n, m)
        self.groups -= len(self._undo)
        self._undo.clear()


def _kind(mods) -> str | None:
    if all(type(m) is nn.Linear for m in mods):
        return "linear"
    if all(type(m) is QuantLinear and m.packed is None for m in mods):
        return "quant"
    return None


def _fusable(mods) -> str | None:
    kind = _kind(mods)
    if kind is None:
        return "not plain nn.Linear or unpacked QuantLinear (packed, wrapped or already fused)"
    ref = mods[0].weight if kind == "linear" else mods[0].scale
    if any(m.in_features != mods[0].in_features for m in mods):
        return "different inputs"
    if kind == "linear" and any(m.weight.dtype != ref.dtype or m.weight.device != ref.device for m in mods):
        return "different dtypes or devices"
    if kind == "quant" and any(m.scheme != mods[0].scheme or m.scale.dtype != ref.dtype or m.codes.device != ref.device
                               for m in mods):
        return "different weight schemes, scale dtypes or devices"
    if len({m.bias is None for m in mods}) > 1:
        return "some have a bias, some not"
    return None


def _fused_linear(mods, sizes) -> nn.Module:
    """One nn.Linear [K -> sum(sizes)]; the originals become views of its weight (undo needs no copy)."""
    w0 = mods[0].weight
    weight = torch.cat([m.weight for m in mods], 0)  # [sum(sizes), K]
    lin = nn.Linear(w0.shape[1], weight.shape[0], bias=mods[0].bias is not None, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    for m, w in zip(mods, weight.split(sizes, 0)):
        m.weight = nn.Parameter(w, requires_grad=False)
    if mods[0].bias is not None:
        bias = torch.cat([m.bias for m in mods], 0)
        lin.bias = nn.Parameter(bias, requires_grad=False)
        for m, b in zip(mods, bias.split(sizes, 0)):
            m.bias = nn.Parameter(b, requires_grad=False)
    return lin


def _fused_quant(mods):
    """One QuantLinear [K -> sum(sizes)] holding the parts' codes, scales and zero points stacked along out
    (each row of a QuantLinear is quantized on its own, so stacking rows is exact)."""
    m0 = mods[0]
    out = sum(m.out_features for m in mods)
    q = QuantLinear(m0.in_features, out, m0.scheme, bias=m0.bias is not None, scale_dtype=m0.scale.dtype)
    q.codes = torch.cat([m.codes for m in mods], 0)
    q.scale = torch.cat([m.scale for m in mods], 0)
    q.zero_point = torch.cat([m.zero_point for m in mods], 0)
    if m0.bias is not None:
        q.bias = torch.cat([m.bias for m in mods], 0)
    return q


@torch.no_grad()
def fuse_projections(model) -> FusedProjections:
    """Fuse q/k/v and gate/up of every decoder layer of `model` in place (module docstring)."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise LowbitError(f"{type(model).__name__}: expected .model.layers to fuse projections in")
    handle = FusedProjections()
    for i, layer in enumerate(layers):
        for owner_name, names in GROUPS.items():
            owner = getattr(layer, owner_name, None)
            if owner is None or not all(hasattr(owner, n) for n in names):
                continue
            mods = [getattr(owner, n) for n in names]
            why = _fusable(mods)
            if why:
                handle.skipped.append(f"layer {i} {owner_name}: {why}")
                continue
            sizes = [m.out_features for m in mods]
            quant = _kind(mods) == "quant"
            linear = _fused_quant(mods) if quant else _fused_linear(mods, sizes)
            pending = _Pending(len(mods))
            setattr(owner, names[0], FusedHead(linear, sizes, pending))
            for j, (n, m) in enumerate(zip(names[1:], mods[1:]), start=1):
                setattr(owner, n, FusedTail(j, m.in_features, m.out_features, pending))
            if not quant:
                handle._undo.append((owner, names, mods))
            handle.groups += 1
    return handle
