import pytest
import torch

from lowbit.weights.gptq import rtn_quantize
from lowbit.weights.qlinear import QuantLinear, quantize_activations_per_token
from lowbit.weights.scheme import parse_weight_scheme


def _qlin(name, out=13, n=192, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, n, generator=g) * 0.1
    b = torch.randn(out, generator=g) if bias else None
    s = parse_weight_scheme(name)
    q = rtn_quantize(W, s.w_bits, s.group_for(n), s.symmetric)
    return QuantLinear.from_codes(q.codes, q.grid, s, b), q, b


@pytest.mark.parametrize("name", ["w4a16-g64-asym", "w4a16-g64", "w8a16"])
def test_a16_forward_is_linear_with_the_dequantized_weight(name):
    m, q, b = _qlin(name)
    torch.testing.assert_close(m.dequantized_weight(), q.dequantize(), atol=1e-6, rtol=0)
    x = torch.randn(3, 5, 192)
    torch.testing.assert_close(m(x), torch.nn.functional.linear(x, q.dequantize(), b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, rows", [("w8a8", 1), ("w8a8", 17), ("w4a8-g64", 3)])
def test_a8_forward_is_the_fake_quantized_linear(name, rows):
    m, q, b = _qlin(name)
    x = torch.randn(rows, 192) * 2
    xq, sx = quantize_activations_per_token(x)
    # bit for bit the reload's arithmetic: the codes times the scale, then the float linear
    assert torch.equal(m(x), torch.nn.functional.linear(xq.float() * sx, m.dequantized_weight(), b))
    # every row reaches the range's end: +amax -> 127, -amax -> -128 (compressed-tensors' 127.5 scale)
    assert xq.dtype == torch.int8 and set(xq.int().abs().amax(-1).tolist()) <= {127, 128}
    # reference: dequantized activations times dequantized weights, in float64
    ref = (xq.double() * sx.double()) @ q.dequantize().double().T + b.double()
    torch.testing.assert_close(m(x).double(), ref, atol=1e-4, rtol=1e-5)
    # and activation quantization is really applied (differs from the a16 result)
    assert not torch.allclose(m(x), torch.nn.functional.linear(x, q.dequantize(), b), atol=1e-6)


def test_zero_rows_do_not_nan():
    m, _, _ = _qlin("w8a8", bias=False)
    y = m(torch.zeros(2, 192))
    assert torch.equal(y, torch.zeros(2, 13))
