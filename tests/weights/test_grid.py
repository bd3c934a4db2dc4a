import torch

from lowbit.quant import affine
from lowbit.weights import grid as G


def _w(out=7, n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, n, generator=g) * 0.1


def test_encode_is_affines_formula_on_affines_own_grid():
    w = _w()
    q = affine.quantize(w, 4, 32)
    codes = G.encode(w.reshape(7, 3, 32), q.scale.unsqueeze(-1), q.zero.unsqueeze(-1), 4).reshape(7, 96)
    assert torch.equal(codes, q.codes)


def test_asymmetric_grid_is_integer_and_covers_zero():
    w = _w() + 0.3  # most groups all-positive: the zero-point must still fit 4 bits
    g = G.grid_for_clip(w, 4, 32, False, 1.0)
    assert g.zero_point.dtype == torch.int32
    assert int(g.zero_point.min()) >= -8 and int(g.zero_point.max()) <= 7
    # zero is an integer multiple of scale: the grid compressed-tensors stores
    k = -g.zero / g.scale
    torch.testing.assert_close(k, k.round(), atol=1e-4, rtol=0)
    # error bounded by half a step everywhere (range holds all values and 0)
    err = (G.dequantize_on(G.quantize_on(w, g), g) - w).abs()
    step = g.scale.repeat_interleave(32, dim=1)
    assert bool((err <= step * 0.5 + 1e-6).all())


def test_symmetric_grid_is_the_signed_grid():
    w = _w(5, 64)
    g = G.grid_for_clip(w, 4, 64, True, 1.0)
    assert torch.equal(g.zero_point, torch.zeros_like(g.zero_point))
    torch.testing.assert_close(g.zero, -8 * g.scale)
    # scale = amax / 7.5, compressed-tensors' symmetric scale
    torch.testing.assert_close(g.scale.squeeze(1), w.abs().amax(1) / 7.5)
    q = G.quantize_on(w, g).int() - 8  # signed codes
    assert int(q.min()) >= -8 and int(q.max()) <= 7


def test_ct_zero_point_matches_compressed_tensors_dequantize():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    w = _w(6, 64)
    g = G.fit_grid(w, 4, 32, False)
    codes = G.quantize_on(w, g)
    q = (codes.to(torch.int16) - 8).to(torch.int8)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)
    ct = dequantize(q, g.scale, g.zero_point.to(torch.int8), args=args)
    torch.testing.assert_close(ct.float(), G.dequantize_on(codes, g), atol=1e-6, rtol=0)


def test_clip_search_never_worse_and_picks_per_group():
    w = _w(9, 96, seed=3)
    w[0, 5] = 3.0  # one outlier: its group wants clipping, the others do not
    plain = G.grid_for_clip(w, 4, 32, False, 1.0)
    best = G.fit_grid(w, 4, 32, False)
    e = lambda g: (G.dequantize_on(G.quantize_on(w, g), g) - w).pow(2).reshape(9, 3, 32).sum(-1)
    assert bool((e(best) <= e(plain) + 1e-9).all())
    assert float(e(best).sum()) < float(e(plain).sum())
    assert len(set(best.clip.flatten().tolist())) > 1  # ratios differ between groups


def test_scale_dtype_rounds_scale_to_storage_dtype():
    w = _w()
    g = G.fit_grid(w, 4, 32, False, scale_dtype=torch.bfloat16)
    assert torch.equal(g.scale, g.scale.to(torch.bfloat16).float())
