"""The one int8 activation quantizer of the W8A8 / W4A8 schemes: dynamic, symmetric, per token.

lowbit exports these schemes as compressed-tensors with input_activations = {num_bits 8, type int,
symmetric, strategy token, dynamic}. Whoever reloads the checkpoint (transformers' compressed-tensors
integration) quantizes the activations with compressed-tensors' own arithmetic, so lowbit's forward,
its Triton kernels and their torch twins all use that arithmetic, bit for bit:

    amax = max |x| over the row                                  (in x's dtype: exact)
    s    = amax / 127.5                                          (in x's dtype, rounded as torch rounds it)
    s    = eps(x's dtype) where s == 0                           (an all-zero row: codes 0, s = eps)
    q    = round_half_even(clamp(x / s, -128, 127))              (x / s in x's dtype)

127.5 is half of compressed-tensors' int8 range width (127 - (-128)) / 2, so +amax lands on 127.5 and
is clamped to 127, and -amax lands on -127.5 and rounds (half to even) to -128. vLLM's own int8 kernel
divides by 127 instead; a checkpoint served there is quantized the vLLM way by vLLM itself.
(compressed_tensors 0.20: quantization/utils/helpers.py calculate_qparams and
compute_dynamic_scales_and_zp, _calculate_range; quant_args.py round_to_quantized_type_args;
lifecycle/forward_helpers.py _quantize_dequantize.)

Rows: lowbit quantizes each row of x [M, K]; compressed-tensors' token strategy reduces every dim but
the first two, so it is the same per-token quantization for the [batch, seq, K] input an HF decoder
linear receives (a 2-D input there would be quantized per tensor).
"""

from __future__ import annotations

import torch

A8_QMIN, A8_QMAX = -128, 127  # compressed-tensors' int8 range
A8_DIV = (A8_QMAX - A8_QMIN) / 2  # 127.5: the symmetric scale divides amax by half the range width


def act_eps(dtype: torch.dtype) -> float:
    """The scale an all-zero row gets (compressed-tensors: finfo(scale dtype).eps)."""
    return torch.finfo(dtype).eps


def quantize_activations_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float (fp32 / bf16 / fp16) -> (x_q int8 [M, K], s_x float32 [M, 1]).

    Computed in x's dtype with compressed-tensors' op sequence (module docstring), so the codes and the
    scale (exactly representable in x's dtype, returned widened to float32) equal its own."""
    if not x.is_floating_point():
        raise TypeError(f"activations must be floating point, got {x.dtype}")
    amax = x.abs().amax(dim=-1, keepdim=True)  # [M, 1], x's dtype
    # a 0-dim tensor on x's device, as compressed-tensors divides by: torch divides by a Python number as
    # a multiply by its reciprocal on CUDA, which can round differently
    s = amax / torch.tensor(A8_DIV, dtype=x.dtype, device=x.device)
    s = torch.where(s == 0, torch.tensor(act_eps(x.dtype), dtype=x.dtype, device=x.device), s)
    q = torch.round(torch.clamp(x / s, A8_QMIN, A8_QMAX))  # x's dtype: integers in [-128, 127], exact
    return q.to(torch.int8), s.float()
