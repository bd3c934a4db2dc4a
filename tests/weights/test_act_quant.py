"""The one int8 activation quantizer (lowbit.weights.act_quant) against compressed-tensors' own.

compressed-tensors is what transformers runs when it reloads a W8A8 / W4A8 checkpoint lowbit exported
(input_activations: int 8, symmetric, token, dynamic); its codes and scales must be ours bit for bit, in
every activation dtype, on odd shapes, with exact ties (x / s = k + 1/2), all-zero rows and -0.0.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.weights.act_quant import A8_DIV, quantize_activations_per_token

ct = pytest.importorskip("compressed_tensors")  # the GPU image has none; the CPU env has 0.20

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1, 1), (1, 3, 7), (3, 7, 99), (2, 5, 1027)]  # [batch, seq, K] as an HF decoder linear sees it


def _args():
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)


def _ct_codes_and_scales(x):
    """compressed-tensors' dynamic per-token scale/zero-point, then its quantize -> (int8 codes, scale)."""
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    s, zp = compute_dynamic_scales_and_zp(value=x, args=_args(), module=torch.nn.Module())
    assert s.dtype == x.dtype and bool((zp == 0).all())  # symmetric: the scale is in x's dtype, zero-point 0
    return quantize(x, s, zp, _args(), dtype=torch.int8), s


def _activations(shape, dtype, seed):
    """Random rows of mixed magnitude plus the hard rows: all zero (one with -0.0), exact ties, one nonzero
    element, a wide dynamic range."""
    B, T, K = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, K, generator=g) * torch.rand(B, T, 1, generator=g).mul(8).exp2() / 16
    x = x.to(dtype)
    rows = x.view(-1, K)
    n = rows.shape[0]
    if n > 1:
        rows[1] = 0
        rows[1, K // 2] = -0.0
    if n > 2:  # x / s = an odd number of halves: every element a tie; amax = 127.5 s, so s = 0.375 exactly
        s0 = 0.375
        half = torch.randint(-128, 127, (K,), generator=g).to(torch.float32) + 0.5
        half[0] = -127.5 if K > 1 else 127.5
        if K > 1:
            half[1] = 127.5
        rows[2] = (half * s0).to(dtype)
    if n > 3:
        rows[3] = 0
        rows[3, -1] = -3.0
    if n > 4:
        rows[4] = torch.logspace(-3, 4, K).to(dtype) * torch.where(torch.arange(K) % 2 == 0, 1.0, -1.0).to(dtype)
    if n > 5:
        rows[5] = 0
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_codes_and_scales_equal_compressed_tensors(shape, dtype):
    x = _activations(shape, dtype, seed=sum(shape))
    K = shape[-1]
    q, s = quantize_activations_per_token(x.reshape(-1, K))
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (x.numel() // K, 1)
    q_ct, s_ct = _ct_codes_and_scales(x)
    assert torch.equal(q.reshape(shape), q_ct)
    assert torch.equal(s.reshape(*shape[:-1], 1), s_ct.float())
    assert torch.equal(s.to(dtype).float(), s)  # the scale is a number of x's dtype, widened exactly


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_ties_round_half_to_even_and_the_range_is_compressed_tensors(dtype):
    # amax 15.9375 = 127.5 / 8, so s = 1/8 and x = r / 8 holds x / s = r exactly in every dtype
    r = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 127.5, -127.5, 0.0, 3.25])
    x = (r / 8).to(dtype).reshape(1, -1)
    q, s = quantize_activations_per_token(x)
    assert float(s) == 0.125 and 127.5 / A8_DIV == 1.0
    # half to even; +amax lands on 127.5 and clamps to 127, -amax on -127.5 and rounds to -128
    assert q[0].tolist() == [0, 2, 2, 0, -2, 126, -126, 127, -128, 0, 3]
    q_ct, _ = _ct_codes_and_scales(x.reshape(1, 1, -1))
    assert torch.equal(q.reshape(1, 1, -1), q_ct)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_all_zero_rows_get_codes_zero_and_scale_eps(dtype):
    x = torch.zeros(3, 1, 5, dtype=dtype)
    x[1, 0, 2] = -0.0
    q, s = quantize_activations_per_token(x.reshape(3, 5))
    assert not q.any() and torch.equal(s, torch.full((3, 1), torch.finfo(dtype).eps))
    q_ct, s_ct = _ct_codes_and_scales(x)
    assert torch.equal(q.reshape(3, 1, 5), q_ct) and torch.equal(s.reshape(3, 1, 1), s_ct.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_the_reloads_fake_quantized_input_is_our_codes_times_our_scale(dtype):
    """What transformers' reloaded linear really feeds its matmul: compressed-tensors' forward_quantize of
    the input (quantize, then dequantize in x's dtype) == our codes * our scale in x's dtype, bit for bit."""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from compressed_tensors.quantization.quant_config import QuantizationStatus

    mod = torch.nn.Linear(99, 4)
    mod.quantization_status = QuantizationStatus.DECOMPRESSED  # the status of a reloaded checkpoint's linear
    x = _activations((3, 7, 99), dtype, seed=5)
    got = forward_quantize(mod, x, "input", _args())
    q, s = quantize_activations_per_token(x.reshape(-1, 99))
    assert got.dtype == dtype
    assert torch.equal(got, (q.to(dtype) * s.to(dtype)).reshape(x.shape))
