"""The middle-tier codec: stored layout (the kernel contract) and reconstruction."""

import pytest
import torch

from lowbit.kv.codec import TensorCodec
from lowbit.kv.scheme import TensorQuant
from lowbit.quant import affine, packing


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits,group,D", [(2, 64, 64), (2, 128, 256), (4, 32, 128), (8, 64, 64), (3, 16, 48)])
def test_token_axis_layout_matches_contract(bits, group, D):
    B, H, T = 2, 3, 5
    c = TensorCodec(TensorQuant(bits=bits, group=group), D, page=4)
    x = _x(B, H, T, D)
    enc = c.encode(x, torch.float32)
    cb = 4 if bits == 3 else bits
    assert enc["codes"].dtype == torch.uint8 and enc["codes"].shape == (B, H, T, D * cb // 8)
    assert enc["scale"].dtype == torch.float16 and enc["scale"].shape == (B, H, T, D // group)
    assert enc["zero"].shape == enc["scale"].shape
    q = affine.quantize(x, bits, group, scale_dtype=torch.float16)
    expect = q.codes if cb == 8 else packing.pack(q.codes, cb, "strided")
    assert torch.equal(enc["codes"], expect)  # strided packing of affine codes
    xh = c.decode(enc)
    assert torch.allclose(xh, affine.dequantize(q), atol=1e-6)
    # x_hat = codes * scale + zero: error within half a step of each group
    step = q.scale.float().repeat_interleave(group, -1)
    assert torch.all((xh - x).abs() <= step * 0.5 + 1e-3)


def test_channel_axis_groups_each_channel_over_a_page():
    B, H, T, D, P = 1, 2, 12, 64, 4
    c = TensorCodec(TensorQuant(bits=2, axis="channel"), D, page=P)
    x = _x(B, H, T, D, seed=1)
    x[..., 5] *= 50  # an outlier channel: per-channel grouping keeps it from hurting the others
    enc = c.encode(x, torch.float32)
    assert enc["scale"].shape == (B, H, T // P, D) and enc["codes"].shape == (B, H, T, D // 4)
    xh = c.decode(enc)
    blk = x.reshape(B, H, T // P, P, D)
    rng = (blk.amax(3) - blk.amin(3)).repeat_interleave(P, 2)  # per (page, channel) range
    assert torch.all((xh - x).abs() <= rng / 6 + 1e-3)  # half of a 2-bit step (range / 3)
    tok = TensorCodec(TensorQuant(bits=2, group=64), D, page=P)
    others = [i for i in range(D) if i != 5]
    err_c = (xh - x)[..., others].pow(2).mean()
    err_t = (tok.decode(tok.encode(x, torch.float32)) - x)[..., others].pow(2).mean()
    assert err_c < err_t / 10
    with pytest.raises(Exception, match="pages"):
        c.encode(x[:, :, :5], torch.float32)


def test_sixteen_bits_stores_dense_in_model_dtype():
    c = TensorCodec(TensorQuant(bits=16), 64, page=4)
    x = _x(1, 1, 3, 64).bfloat16()
    enc = c.encode(x, torch.bfloat16)
    assert set(enc) == {"dense"} and enc["dense"].dtype == torch.bfloat16
    assert torch.equal(c.decode(enc, torch.bfloat16), x)


def test_lloyd_max_stores_std_and_mean():
    c = TensorCodec(TensorQuant(bits=2, lloyd_max=True, group=32), 64, page=4)
    x = _x(2, 1, 7, 64, seed=2)
    enc = c.encode(x, torch.float32)
    assert enc["scale"].shape == (2, 1, 7, 2)
    xg = x.reshape(2, 1, 7, 2, 32)
    torch.testing.assert_close(enc["zero"].float(), xg.mean(-1), atol=2e-3, rtol=1e-3)  # zero = mean
    torch.testing.assert_close(enc["scale"].float(), xg.std(-1, correction=0), atol=2e-3, rtol=1e-3)
    assert c.levels.shape == (4,)
