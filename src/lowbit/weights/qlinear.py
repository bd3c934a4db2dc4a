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

On CUDA, `lowbit.kernels.gemm.prepare.prepare_cuda(model)` repacks every QuantLinear once into the weight
kernels' layout (lowbit.kernels.gemm.triton_gemm.PackedWeight: int4 stays packed, 8 codes per int32), drops the unpacked
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
        # Set together by lowbit.kernels.gemm.prepare (prepare_cuda / attach): the kernels' PackedWeight, the
        # model's Dispatch (or "twin"), and packed_forward(module, x2 [M, in]) -> [M, out] that runs them.
        self.packed = None
        self.dispatch = None
        self.packed_forward = None

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
        if self.packed is not None:  # the weight kernels (lowbit.kernels.gemm.prepare attached them)
            y = self.packed_forward(self, x.reshape(-1, self.in_features))
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.scheme.a_bits == 8:  # the reload's arithmetic (module docstring): codes * scale in x's dtype
            xq, sx = quantize_activations_per_token(x.reshape(-1, self.in_features))  # int8 [M, in], f32 [M, 1]
            x = (xq.to(x.dtype) * sx.to(x.dtype)).reshape(x.shape)
        w = self.dequantized_weight().to(x.dtype)
        return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme.name}, group={self.group}"
