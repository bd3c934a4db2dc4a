"""Put a model's QuantLinear modules on the GPU weight kernels: pack once, resolve one dispatch, self-check it.

    rep = prepare_cuda(model)            # every QuantLinear: packed, dispatched, self-checked (CUDA)
    attach(module, "twin")               # one module on the torch twin of the packed path (tests, CPU)

QuantLinear (lowbit.weights.qlinear) holds the codes and a plain-torch forward; it knows no kernel. This
module gives it `packed` (a PackedWeight: int4 stays packed, 8 codes per int32), `dispatch` (the model's
Dispatch, trimmed by a self-check of each distinct shape against the torch twin, or "twin" when asked
for by name) and `packed_forward`, which its forward then calls: one opaque custom op inside a
torch.compile trace (lowbit.kernels.ops), else the dispatch's kernel for the batch size.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.core.errors import LowbitError
from lowbit.kernels.gemm import triton_gemm
from lowbit.kernels.gemm.check import cell_passes, check_cell
from lowbit.kernels.gemm.dispatch import Dispatch
from lowbit.kernels.ops import traced_packed_linear
from lowbit.weights.qlinear import QuantLinear


def pack_module(m: QuantLinear):
    """The module's weight as a PackedWeight (on the module's device)."""
    return triton_gemm.pack_weight(m.codes, m.scale, None if m.scheme.symmetric else m.zero_point,
                                   bits=m.bits, group=m.group, a_bits=m.scheme.a_bits, bias=m.bias)


def packed_forward(m: QuantLinear, x2: torch.Tensor) -> torch.Tensor:
    """x2 [M, in] -> [M, out] through the module's packed weight (what QuantLinear.forward calls)."""
    if torch.compiler.is_compiling():  # one opaque node (lowbit.kernels.ops): dynamo cannot trace ctypes
        return traced_packed_linear(m, x2)
    return triton_gemm.linear_twin(x2, m.packed) if m.dispatch == "twin" else m.dispatch.linear(x2, m.packed)


def attach(m: QuantLinear, dispatch, packed=None) -> None:
    """Route `m`'s forward through `packed` (default: packed now from its codes) and `dispatch` ("twin": the
    torch twin of the packed path; else a Dispatch)."""
    m.packed = packed if packed is not None else pack_module(m)
    m.dispatch = dispatch
    m.packed_forward = packed_forward


def prepare_cuda(model: nn.Module, *, kernel: str = "auto", check_ms=(1, 16, 17, 129, 1025), log=None) -> dict:
    """Repack every QuantLinear of a CUDA model for the weight kernels (see module docstring).

    kernel: "auto" (the dispatch table, minus cells whose self-check fails) or "twin" (torch, by name).
    Returns {"dispatch", "removed", "modules", "packed_bytes", "bf16_bytes"}: the bytes held by the
    packed weights against the same weights in bf16."""
    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not mods:
        raise LowbitError("the model has no QuantLinear modules: nothing to prepare for the weight kernels")
    dev = mods[0].codes.device
    if dev.type != "cuda":
        raise LowbitError(f"prepare_cuda needs the model on a CUDA device, it is on {dev}: call model.cuda() first")
    if kernel not in ("auto", "twin"):
        raise LowbitError(f"weight kernel {kernel!r}: use auto (the dispatch table) or twin (torch, slow)")
    for m in mods:
        m.packed = pack_module(m)
        m.codes = torch.empty(0, dtype=torch.uint8, device=dev)  # the packed copy replaces it
    removed: list[str] = []
    if kernel == "twin":
        disp = "twin"
    else:
        disp = Dispatch.for_device(dev)
        seen, failed = set(), []
        for m in mods:
            key = (m.packed.kind, m.packed.N, m.packed.K, m.packed.group, m.packed.zero is not None)
            if key in seen:
                continue
            seen.add(key)
            for M in check_ms:
                rel, finite, name = check_cell(disp, m.packed, M, device=dev)
                if not cell_passes(rel, finite, name):
                    failed.append((m.packed.kind, M, name))
                    removed.append(f"{name} {m.packed.kind} M={M} N={m.packed.N} K={m.packed.K}: rel {rel:.3g}"
                                   f"{'' if finite else ' (non-finite)'}")
                    if log:
                        log(f"weight kernel self-check FAILED, cell removed: {removed[-1]}")
        disp = disp.without(failed)
        for k in {m.packed.kind for m in mods}:
            disp.choose(k, 1)  # a kind with nothing left is an error now, not at the first token
    for m in mods:
        attach(m, disp, m.packed)
    return {"dispatch": disp if disp == "twin" else disp.source, "removed": removed, "modules": len(mods),
            "packed_bytes": sum(m.packed.nbytes() for m in mods),
            "bf16_bytes": sum(2 * m.in_features * m.out_features for m in mods)}
