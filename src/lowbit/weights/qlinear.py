"""QuantLinear: a linear layer holding integer weight codes, with a plain-torch reference forward.

Stored (buffers), for weight [out, in] in G = in // group groups:
    codes       uint8 [out, in]   unsigned codes c in [0, 2**b - 1] (kept unpacked in memory;
                                  packing is a storage concern, see export.py)
    scale       [out, G]          the checkpoint's scale dtype
    zero_point  int8 [out, G]     compressed-tensors' signed zero-point (all 0 when symmetric)
    bias        [out] or absent
The weight is w = (c - 2**(b-1) - zero_point) * scale = (q - zero_point) * scale with q the
signed code compressed-tensors stores -- the same numbers grid.dequantize_on gives.

Forward:
    a_bits 16: y = x @ w^T (w dequantized in float32, cast to x's dtype).
    a_bits 8:  activations quantized per token, symmetric int8, on the fly (dynamic), by the one
               quantizer (weights/act_quant.py: compressed-tensors' arithmetic, s_x = amax|x| / 127.5,
               x_q = round_half_even(clamp(x / s_x, -128, 127)) in x's dtype); then
               y = linear(x_q * s_x, w) in x's dtype, w dequantized. That is the reload's own arithmetic
               (compressed-tensors fake-quantizes the input the same way, then runs the float linear),
               so this forward is bit for bit what transformers computes from the exported checkpoint.
               An integer GEMM cannot be: its sums round differently from the float matmul's, and a
               1e-7 difference in one layer's output moves some next activation across a rounding
               boundary (one int8 step), which a near-tie in the logits can turn into another token.
               The GPU kernels (prepare_cuda) run the same codes through int8 x int8 -> int32.

On CUDA, `prepare_cuda(model)` repacks every QuantLinear once into the weight kernels' layout
(lowbit.kernels.gemm.triton_gemm.PackedWeight: int4 stays packed, 8 codes per int32), drops the unpacked
codes, and routes forward through one Dispatch resolved for the model (the table for the device,
trimmed by a self-check of each distinct shape against the torch twin). `kernel="twin"` runs the
twin on the GPU instead: only when asked for by name.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.weights.act_quant import quantize_activations_per_token  # (also imported from here by callers)
from lowbit.weights.grid import Grid
from lowbit.weights.scheme import WeightScheme


class QuantLinear(nn.Module):
    """Drop-in for nn.Linear with quantized weights (see module docstring)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: WeightScheme,
        *,
        bias: bool = False,
        scale_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.group = scheme.group_for(in_features)
        G = in_features // self.group
        self.register_buffer("codes", torch.zeros(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("scale", torch.ones(out_features, G, dtype=scale_dtype))
        self.register_buffer("zero_point", torch.zeros(out_features, G, dtype=torch.int8))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=scale_dtype))
        else:
            self.bias = None
        self.packed = None  # PackedWeight once prepare_cuda ran
        self.dispatch = None  # the model's Dispatch, or "twin"

    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, grid: Grid, scheme: WeightScheme, bias: torch.Tensor | None = None,
        scale_dtype: torch.dtype = torch.float32,
    ) -> QuantLinear:
        """Build from GPTQ/RTN output: codes uint8 [out, in] on `grid` (see grid.Grid)."""
        out, n = codes.shape
        m = cls(n, out, scheme, bias=bias is not None, scale_dtype=scale_dtype)
        if grid.group != m.group or grid.bits != scheme.w_bits:
            raise ValueError(f"grid (bits {grid.bits}, group {grid.group}) does not match scheme {scheme.name}")
        m.codes.copy_(codes)
        m.scale.copy_(grid.scale.to(scale_dtype))
        m.zero_point.copy_(grid.zero_point.to(torch.int8))
        if bias is not None:
            m.bias.copy_(bias.detach())
        return m

    @property
    def bits(self) -> int:
        return self.scheme.w_bits

    def int_weight(self) -> torch.Tensor:
        """(q - zero_point) as int16 [out, in]: the integer weight before the scale."""
        half = 1 << (self.bits - 1)
        zp = self.zero_point.to(torch.int16).repeat_interleave(self.group, dim=1)
        return self.codes.to(torch.int16) - half - zp

    def signed_codes(self) -> torch.Tensor:
        """q = c - 2**(b-1), int8 [out, in]: what compressed-tensors stores."""
        return (self.codes.to(torch.int16) - (1 << (self.bits - 1))).to(torch.int8)

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in] = (q - zero_point) * scale."""
        s = self.scale.float().repeat_interleave(self.group, dim=1)
        return self.int_weight().float() * s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out]
        if self.packed is not None:
            from lowbit.kernels.gemm import triton_gemm as weight_gemm

            x2 = x.reshape(-1, self.in_features)
            if torch.compiler.is_compiling():  # one opaque node (lowbit.kernels.ops): dynamo cannot trace ctypes
                from lowbit.kernels.ops import traced_packed_linear

                return traced_packed_linear(self, x2).reshape(*x.shape[:-1], self.out_features)
            y = (weight_gemm.linear_twin(x2, self.packed) if self.dispatch == "twin"
                 else self.dispatch.linear(x2, self.packed))
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.scheme.a_bits == 8:  # the reload's arithmetic (module docstring): codes * scale in x's dtype
            xq, sx = quantize_activations_per_token(x.reshape(-1, self.in_features))  # int8 [M, in], f32 [M, 1]
            x = (xq.to(x.dtype) * sx.to(x.dtype)).reshape(x.shape)
        w = self.dequantized_weight().to(x.dtype)
        return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def to_packed(self):
        """The weight as a PackedWeight (on this module's device)."""
        from lowbit.kernels.gemm.triton_gemm import pack_weight

        return pack_weight(self.codes, self.scale, None if self.scheme.symmetric else self.zero_point,
                           bits=self.bits, group=self.group, a_bits=self.scheme.a_bits, bias=self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme.name}, group={self.group}"


def prepare_cuda(model: nn.Module, *, kernel: str = "auto", check_ms=(1, 16, 17, 129, 1025), log=None) -> dict:
    """Repack every QuantLinear of a CUDA model for the weight kernels (see module docstring).

    kernel: "auto" (the dispatch table, minus cells whose self-check fails) or "twin" (torch, by name).
    Returns {"dispatch", "removed", "modules", "packed_bytes", "bf16_bytes"}: the bytes held by the
    packed weights against the same weights in bf16."""
    from lowbit.core.errors import LowbitError

    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not mods:
        raise LowbitError("the model has no QuantLinear modules: nothing to prepare for the weight kernels")
    dev = mods[0].codes.device
    if dev.type != "cuda":
        raise LowbitError(f"prepare_cuda needs the model on a CUDA device, it is on {dev}: call model.cuda() first")
    if kernel not in ("auto", "twin"):
        raise LowbitError(f"weight kernel {kernel!r}: use auto (the dispatch table) or twin (torch, slow)")
    for m in mods:
        m.packed = m.to_packed()
        m.codes = torch.empty(0, dtype=torch.uint8, device=dev)  # the packed copy replaces it
    removed: list[str] = []
    if kernel == "twin":
        disp = "twin"
    else:
        from lowbit.kernels.gemm.check import cell_passes, check_cell
        from lowbit.kernels.gemm.dispatch import Dispatch

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
        m.dispatch = disp
    return {"dispatch": disp if disp == "twin" else disp.source, "removed": removed, "modules": len(mods),
            "packed_bytes": sum(m.packed.nbytes() for m in mods),
            "bf16_bytes": sum(2 * m.in_features * m.out_features for m in mods)}
