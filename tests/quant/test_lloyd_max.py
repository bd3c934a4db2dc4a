import dataclasses

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.quant import gaussian as gs
from lowbit.quant import lloyd_max as lm
from lowbit.quant.affine import dequantize, quantize

# Published Lloyd-Max levels for N(0, 1) (Max 1960); the code derives them, the test checks.
KNOWN = {
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3440, 2.1520],
    4: [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326],
}
KNOWN_MSE = {2: 0.1175, 3: 0.03455, 4: 0.0095}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gaussian_levels_match_known(bits):
    lv = gs.gaussian_levels(bits)
    assert lv.dtype == torch.float64 and lv.shape == (2**bits,)
    assert (lv[1:] > lv[:-1]).all()
    torch.testing.assert_close(lv, -lv.flip(0), rtol=0, atol=1e-12)
    pos = lv[2 ** (bits - 1) :]
    torch.testing.assert_close(pos, torch.tensor(KNOWN[bits], dtype=torch.float64), rtol=0, atol=1e-3)
    assert gs.gaussian_distortion(bits) == pytest.approx(KNOWN_MSE[bits], rel=2e-3)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gaussian_levels_are_lloyd_fixed_point(bits):
    # centroid condition: each level is E[X | X in its cell] with midpoint thresholds
    lv = gs.gaussian_levels(bits).tolist()
    t = gs._thresholds(lv)
    for i, level in enumerate(lv):
        p, m1, _ = gs._cell_moments(t[i], t[i + 1])
        assert m1 / p == pytest.approx(level, abs=1e-9)
    # and it beats a nearby perturbed codebook
    nudged = gs.gaussian_levels(bits) * 1.02
    assert gs.gaussian_distortion(nudged) > gs.gaussian_distortion(bits)


def test_gaussian_levels_cached_but_not_shared():
    a = gs.gaussian_levels(2)
    a[0] = 99.0
    assert gs.gaussian_levels(2)[0] == pytest.approx(-1.5104, abs=1e-3)
    assert gs._gaussian_levels.cache_info().hits >= 1


@pytest.mark.parametrize("bits", [0, 5, 8])
def test_gaussian_levels_bad_bits(bits):
    with pytest.raises(LowbitError, match="bits"):
        gs.gaussian_levels(bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_encode_gaussian_beats_uniform(bits):
    x = _randn(999, 128, seed=bits)
    q = lm.encode(x, gs.gaussian_levels(bits), 128)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape and q.bits == bits
    assert q.mean.shape == (999, 1) == q.std.shape
    mse = float((lm.decode(q) - x).pow(2).mean())
    uni = float((dequantize(quantize(x, bits, 128)) - x).pow(2).mean())
    assert mse < uni
    # and lands near the theoretical distortion (the group std is estimated from 128 samples)
    assert mse == pytest.approx(gs.gaussian_distortion(bits), rel=0.1)


@pytest.mark.parametrize("shape", [(1, 16), (3, 99, 32), (5, 1, 7, 48)])
def test_encode_decode_shapes_and_nearest_level(shape):
    x = _randn(*shape, seed=1) * 2 + 0.5
    lv = gs.gaussian_levels(3)
    q = lm.encode(x, lv, 16)
    assert q.mean.shape == (*shape[:-1], shape[-1] // 16)
    xh = lm.decode(q)
    assert xh.shape == x.shape and xh.dtype == torch.float32
    # each code is the nearest level to the standardized value
    G = shape[-1] // 16
    z = (x.reshape(*shape[:-1], G, 16) - q.mean[..., None]) / q.std[..., None]
    d = (z.unsqueeze(-1) - lv.float()).abs()  # [..., G, 16, K]
    chosen = d.gather(-1, q.codes.reshape(*shape[:-1], G, 16, 1).long()).squeeze(-1)
    assert (chosen <= d.amin(-1) + 1e-6).all()


def test_constant_groups_exact_and_finite():
    x = torch.zeros(3, 8)
    x[1] = 4.25
    x[2, :4] = -3.0
    x[2, 4:] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    q = lm.encode(x, gs.gaussian_levels(2), 4)
    xh = lm.decode(q)
    assert torch.isfinite(xh).all()
    torch.testing.assert_close(xh[:2], x[:2], rtol=0, atol=0)
    torch.testing.assert_close(xh[2, :4], x[2, :4], rtol=0, atol=0)
    # group of 1: std 0, exact
    y = _randn(3, 5)
    torch.testing.assert_close(lm.decode(lm.encode(y, gs.gaussian_levels(2), 1)), y, rtol=0, atol=0)


@pytest.mark.parametrize("stat_dtype", [torch.float16, torch.bfloat16])
def test_bf16_input_and_low_precision_stats(stat_dtype):
    x = (_randn(7, 99, 64, seed=4) * 0.2 + 1.0).to(torch.bfloat16)
    lv = gs.gaussian_levels(4)
    q = lm.encode(x, lv, 32, stat_dtype=stat_dtype)
    assert q.mean.dtype == stat_dtype == q.std.dtype
    q32 = lm.encode(x, lv, 32)
    err = (lm.decode(q) - x.float()).pow(2).mean()
    err32 = (lm.decode(q32) - x.float()).pow(2).mean()
    assert err <= err32 * 1.2
    assert lm.decode(q, torch.bfloat16).dtype == torch.bfloat16


def test_fit_levels_recovers_gaussian():
    x = _randn(1 << 18, seed=2)
    for bits in (2, 3):
        f = lm.fit_levels(x, bits)
        assert f.dtype == torch.float32 and f.shape == (2**bits,)
        # sampling noise moves the tail levels most; the distortion is what must match
        torch.testing.assert_close(f.double(), gs.gaussian_levels(bits), rtol=0, atol=0.04)
        assert gs.gaussian_distortion(f.double()) < gs.gaussian_distortion(bits) * 1.005


def test_fit_levels_beats_gaussian_on_non_gaussian_data():
    g = torch.Generator().manual_seed(5)
    # bimodal groups: Gaussian levels put codes in the empty middle
    x = torch.randn(333, 64, generator=g) * 0.3 + torch.where(
        torch.rand(333, 64, generator=g) < 0.5, -2.0, 2.0
    )
    for bits in (2, 3):
        fit = lm.fit_levels(x, bits, group=64)
        e_fit = float((lm.decode(lm.encode(x, fit, 64)) - x).pow(2).mean())
        e_gauss = float((lm.decode(lm.encode(x, gs.gaussian_levels(bits), 64)) - x).pow(2).mean())
        assert e_fit < 0.8 * e_gauss


def test_fit_levels_degenerate_and_errors():
    f = lm.fit_levels(torch.full((100,), 3.0), 2)  # one distinct value: levels repeat, finite
    assert torch.isfinite(f).all() and (f == 3.0).all()
    f2 = lm.fit_levels(torch.tensor([0.0, 1.0] * 50), 2)
    assert (f2[1:] >= f2[:-1]).all() and set(f2.tolist()) == {0.0, 1.0}
    with pytest.raises(LowbitError, match="no samples"):
        lm.fit_levels(torch.zeros(0), 2)
    with pytest.raises(LowbitError, match="bits"):
        lm.fit_levels(torch.zeros(8), 9)
    with pytest.raises(LowbitError, match="inf or NaN"):
        lm.fit_levels(torch.tensor([0.0, float("nan")]), 2)


def test_encode_errors():
    x = _randn(2, 576)
    lv = gs.gaussian_levels(2)
    with pytest.raises(LowbitError, match="group 128 does not divide dim 576"):
        lm.encode(x, lv, 128)
    with pytest.raises(LowbitError, match="ascending"):
        lm.encode(x, lv.flip(0), 64)
    with pytest.raises(LowbitError, match="1-D"):
        lm.encode(x, lv.reshape(2, 2), 64)
    y = x.clone()
    y[0, 0] = float("inf")
    with pytest.raises(LowbitError, match="inf or NaN"):
        lm.encode(y, lv, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lm.encode(x, lv, 64).group = 3


@pytest.mark.parametrize("bits,step", [(2, 0.9957), (3, 0.5860), (4, 0.3352)])
def test_gaussian_uniform_step_matches_max_1960(bits, step):
    from lowbit.quant.gaussian import gaussian_uniform_step

    s = gaussian_uniform_step(bits)
    assert s == pytest.approx(step, abs=2e-4)
    K = 1 << bits
    d = lambda st: gs.gaussian_distortion(torch.tensor([(i - (K - 1) / 2) * st for i in range(K)], dtype=torch.float64))
    assert d(s) < d(s * 1.01) and d(s) < d(s * 0.99)  # a minimum, not just a match to the table
