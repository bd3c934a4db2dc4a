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
    a_bits 8:  activations quantized per token, symmetric int8, on the fly (dynamic):
               s_x = amax|x| / 127, x_q = clamp(round(x / s_x), -128, 127); then an integer
               matmul per weight group, y = s_x * sum_g scale_g * (x_q,g @ (q_g - zp_g)^T).
               torch._int_mm (int8 x int8 -> int32) runs it on CPU; where it raises we fall back
               to an int32 matmul (same integers, slower) and log why once.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lowbit.weights.grid import Grid
from lowbit.weights.scheme import WeightScheme

log = logging.getLogger("lowbit.weights.qlinear")
_INT_MM_OK: dict[str, bool] = {}


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b int8 [K, N] -> int32 [M, N], exact."""
    key = a.device.type
    if _INT_MM_OK.get(key, True):
        try:
            return torch._int_mm(a, b)
        except (RuntimeError, NotImplementedError) as e:
            _INT_MM_OK[key] = False
            log.warning("torch._int_mm unavailable on %s (%s); using int32 matmul", key, str(e).splitlines()[0])
    if a.device.type != "cpu":  # GPUs have no int32 matmul; float64 holds these sums exactly (< 2**53)
        return (a.double() @ b.double()).to(torch.int32)
    return a.to(torch.int32) @ b.to(torch.int32)


def quantize_activations_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q int8 [M, K], s_x float32 [M, 1]); symmetric, dynamic per row."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(xf / s).clamp_(-128, 127).to(torch.int8), s


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
        if self.scheme.a_bits == 16:
            w = self.dequantized_weight().to(x.dtype)
            return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        xq, sx = quantize_activations_per_token(x2)  # int8 [M, in], [M, 1]
        wi = self.int_weight()  # [out, in] int16 with values in the signed int8 range (symmetric weights)
        G, g = self.in_features // self.group, self.group
        y = torch.zeros(x2.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        scale = self.scale.float()  # [out, G]
        for j in range(G):
            sl = slice(j * g, (j + 1) * g)
            acc = int8_matmul(xq[:, sl].contiguous(), wi[:, sl].to(torch.int8).t().contiguous())  # [M, out] int32
            y += acc.float() * scale[:, j].unsqueeze(0)
        y = y * sx
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme.name}, group={self.group}"
