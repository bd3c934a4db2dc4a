import dataclasses
import itertools

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.quant import affine
from lowbit.quant.affine import dequantize, mse_clip_search, quantize


def _x(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _mse(x, **kw):
    return float((dequantize(quantize(x, **kw)) - x.float()).pow(2).mean())


@pytest.mark.parametrize("symmetric", [False, True])
def test_error_decreases_with_bits(symmetric):
    x = _x(3, 99, 64)
    errs = [_mse(x, bits=b, group=32, symmetric=symmetric) for b in (2, 3, 4, 8)]
    assert all(a > 2 * b for a, b in itertools.pairwise(errs)), errs
    assert errs[-1] < 1e-4


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(1, 32), (3, 96), (99, 1, 48), (5, 3, 7, 24)])
def test_asym_error_bound_and_shapes(bits, shape):
    x = _x(*shape, seed=bits) * 3 + 1.5
    q = quantize(x, bits, 8)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape
    assert q.scale.shape == (*shape[:-1], shape[-1] // 8) == q.zero.shape
    assert q.scale.dtype == torch.float32 == q.zero.dtype
    assert int(q.codes.max()) <= 2**bits - 1
    xh = dequantize(q)
    bound = q.scale.repeat_interleave(8, dim=-1) / 2 + 1e-5
    assert ((xh - x).abs() <= bound).all()
    # min/max grid: each group's min and max are reconstructed (codes 0 and qmax hit)
    cg = q.codes.reshape(-1, 8)
    assert (cg.amin(-1) == 0).all() and (cg.amax(-1) == 2**bits - 1).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_symmetric_codes_centered(bits):
    x = _x(99, 128, seed=1)
    q = quantize(x, bits, 64, symmetric=True)
    mid = (2**bits - 1) / 2
    # one dequant formula: zero = -mid * scale
    torch.testing.assert_close(q.zero, -mid * q.scale)
    assert abs(q.codes.float().mean().item() - mid) < 0.02 * 2**bits
    # sign flip mirrors codes around mid (ties aside)
    qn = quantize(-x, bits, 64, symmetric=True)
    mirrored = (qn.codes.int() == (2**bits - 1) - q.codes.int()).float().mean()
    assert mirrored > 0.999
    xh = dequantize(q)
    assert ((xh - x).abs() <= q.scale.repeat_interleave(64, -1) / 2 + 1e-5).all()
    torch.testing.assert_close(dequantize(qn), -xh)


def test_symmetric_levels_are_symmetric():
    x = torch.tensor([[-2.0, -1.0, 0.5, 2.0]])
    q = quantize(x, 2, 4, symmetric=True)
    levels = torch.arange(4) * q.scale + q.zero
    torch.testing.assert_close(levels, torch.tensor([[-2.0, -2 / 3, 2 / 3, 2.0]]))


def test_group_must_divide():
    x = _x(2, 576)
    with pytest.raises(
        LowbitError, match="group 128 does not divide dim 576; pick a divisor such as 64 or 32"
    ):
        quantize(x, 4, 128)
    with pytest.raises(LowbitError, match="group"):
        quantize(x, 4, 0)
    q = quantize(x, 4, None)  # whole dim
    assert q.group == 576 and q.scale.shape == (2, 1)


@pytest.mark.parametrize("bits", [1, 5, 16, 0])
def test_unknown_bits(bits):
    with pytest.raises(LowbitError, match="bit width"):
        quantize(_x(2, 8), bits, 8)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.01])
def test_bad_clip_ratio(bad):
    with pytest.raises(LowbitError, match="clip ratio"):
        quantize(_x(2, 8), 4, 8, clip_ratio=bad)


def test_rejects_nonfinite_and_integer_input():
    x = _x(2, 8)
    x[1, 3] = float("inf")
    with pytest.raises(LowbitError, match="inf or NaN"):
        quantize(x, 4, 8)
    x[1, 3] = float("nan")
    with pytest.raises(LowbitError, match="inf or NaN"):
        quantize(x, 4, 8)
    with pytest.raises(LowbitError, match="floating"):
        quantize(torch.ones(2, 8, dtype=torch.int32), 4, 8)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [False, True])
def test_constant_groups_exact(scale_dtype, symmetric):
    x = torch.zeros(3, 16)
    x[0] = 0.0
    x[1, :8] = 2.5
    x[1, 8:] = -7.0
    x[2, :8] = 1e-30  # denormal-ish constant
    x[2, 8:] = torch.randn(8)
    q = quantize(x, 2, 8, symmetric=symmetric, scale_dtype=scale_dtype)
    assert torch.isfinite(q.scale).all() and torch.isfinite(q.zero).all() and (q.scale > 0).all()
    xh = dequantize(q)
    assert torch.isfinite(xh).all()
    if not symmetric:  # asym: constant groups are exact (up to the dtype of zero)
        torch.testing.assert_close(xh[:2], x[:2].to(scale_dtype).float(), rtol=0, atol=0)
    torch.testing.assert_close(xh[0], x[0], rtol=0, atol=0)


def test_clip_shrinks_range_toward_center():
    x = torch.tensor([[-1.0, 0.0, 2.0, 3.0]])
    q = quantize(x, 4, 4, clip_ratio=0.5)
    # [min, max] = [-1, 3], center 1, half 2 -> clipped range [0, 2]
    torch.testing.assert_close(q.zero, torch.tensor([[0.0]]))
    torch.testing.assert_close(q.scale, torch.tensor([[2.0 / 15]]))
    torch.testing.assert_close(dequantize(q), torch.tensor([[0.0, 0.0, 2.0, 2.0]]))
    xs = torch.tensor([[-1.05, 0.02, 2.0, 3.0]])
    qs = quantize(xs, 4, 4, symmetric=True, clip_ratio=0.5)  # amax 3 -> 1.5: levels -1.5 + 0.2k
    torch.testing.assert_close(dequantize(qs), torch.tensor([[-1.1, 0.1, 1.5, 1.5]]))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [2, 4])
def test_mse_clip_search(bits, symmetric):
    # heavy-tailed data: clipping should help at low bits
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, 256, generator=g)
    x = x * (1 + 4 * (torch.rand(33, 256, generator=g) < 0.01))  # 1% outliers
    r = mse_clip_search(x, bits, 128, symmetric=symmetric)
    assert 0 < r <= 1
    e_r = _mse(x, bits=bits, group=128, symmetric=symmetric, clip_ratio=r)
    e_1 = _mse(x, bits=bits, group=128, symmetric=symmetric)
    assert e_r <= e_1
    for other in affine.DEFAULT_CLIP_RATIOS:
        assert e_r <= _mse(x, bits=bits, group=128, symmetric=symmetric, clip_ratio=other) + 1e-12
    if bits == 2:
        assert r < 1 and e_r < 0.95 * e_1


def test_mse_clip_search_keeps_one_when_clipping_hurts():
    # uniform values on a grid that 8 bits represent exactly: any clip only adds error
    x = torch.arange(256, dtype=torch.float32).repeat(3, 1)
    assert mse_clip_search(x, 8, 256, ratios=(0.9, 0.8)) == 1.0


def test_bf16_input_math_in_float32():
    x32 = _x(3, 7, 64, seed=5)
    xb = x32.to(torch.bfloat16)
    q = quantize(xb, 4, 32)
    assert q.scale.dtype == torch.float32
    q_ref = quantize(xb.float(), 4, 32)
    assert torch.equal(q.codes, q_ref.codes) and torch.equal(q.scale, q_ref.scale)
    assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16
    assert affine.fake_quantize(xb, 4, 32).dtype == torch.bfloat16


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_low_precision_scale_zero(scale_dtype, bits, symmetric):
    # offset data: zero is large next to scale, the case where naive rounding of zero hurts
    x = _x(99, 128, seed=7) * 0.3 + (0 if symmetric else 0.7)
    q = quantize(x, bits, 64, symmetric=symmetric, scale_dtype=scale_dtype)
    assert q.scale.dtype == scale_dtype == q.zero.dtype
    q32 = quantize(x, bits, 64, symmetric=symmetric)
    err = (dequantize(q) - x).pow(2).mean()
    err32 = (dequantize(q32) - x).pow(2).mean()
    # the rounded scale/zero reconstruct nearly as well as float32 ones
    slack = 1.1 if (bits < 8 or scale_dtype == torch.float16) else 1.6
    assert err <= err32 * slack, (err, err32)
    # the grid, in the stored dtype, still spans each group's range (scale rounded up)
    assert (q.scale.float() >= q32.scale * (1 - 1e-7)).all()


def test_frozen_dataclass():
    q = quantize(_x(1, 8), 4, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.bits = 2


@pytest.mark.parametrize("shape,group", [((1, 64), 64), ((3, 99, 128), 64), ((5, 256), 128)])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quantize_std_grid(shape, group, bits):
    from lowbit.quant.gaussian import gaussian_uniform_step

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(bits)) * 3 + 1
    q = affine.quantize_std(x, bits, group, scale_dtype=torch.float16)
    xg = x.reshape(*shape[:-1], shape[-1] // group, group)
    std = xg.std(-1, correction=0)
    assert torch.allclose(q.scale.float(), std * gaussian_uniform_step(bits), rtol=2e-3)
    xh = affine.dequantize(q)
    assert int(q.codes.max()) <= (1 << bits) - 1
    # centred on the group mean: the mean of the grid's end levels is the mean
    ends = (q.zero.float() + q.scale.float() * ((1 << bits) - 1) / 2)
    assert torch.allclose(ends, xg.mean(-1), atol=2e-2)
    if bits == 2:  # Gaussian data: better than the min/max grid
        mm = affine.dequantize(affine.quantize(x, bits, group))
        assert (xh - x).pow(2).mean() < 0.8 * (mm - x).pow(2).mean()


def test_quantize_std_constant_group_is_exact_and_bad_bits_refused():
    x = torch.full((2, 64), 0.37)
    q = affine.quantize_std(x, 2, 32)
    assert torch.equal(affine.dequantize(q), x)
    with pytest.raises(LowbitError, match="2, 3 or 4 bits"):
        affine.quantize_std(torch.randn(4, 64), 8, 64)
