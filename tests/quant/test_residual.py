"""The 1-bit residual (lowbit.quant.residual) and the codec's residual path: the basis is orthonormal and fixed,
sign bits pack and unpack exactly, the "sign" gain is least-squares and the "qjl" gain unbiased, the codec stores
and counts its fields, and recipes name it per layer with one-line errors for what cannot hold it."""

from __future__ import annotations

import math

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.codec import TensorCodec
from lowbit.kv.held import codec_bits_per_token
from lowbit.kv.scheme import TensorQuant, parse_kv_scheme
from lowbit.quant import residual
from lowbit.quant import scale_format as sf


@pytest.mark.parametrize("D", [8, 64, 128, 256])
def test_basis_is_orthonormal_and_fixed(D):
    S = residual.basis(D)
    assert S.shape == (D, D) and S.dtype == torch.float32
    assert torch.allclose(S @ S.T, torch.eye(D), atol=1e-5)
    assert torch.equal(S, residual._basis_cpu.__wrapped__(D))  # recomputed from the seed: the same matrix
    assert not torch.allclose(S.abs(), torch.eye(D))  # not the identity up to signs: a real second basis


def test_basis_refuses_unpackable_head_dims():
    with pytest.raises(LowbitError, match="multiple of 8"):
        residual.basis(12)


@pytest.mark.parametrize("kind", residual.KINDS)
@pytest.mark.parametrize("fmt", ["fp16", "ue5m3"])
def test_encode_decode_signs_and_gains(kind, fmt):
    g = torch.Generator().manual_seed(1)
    r = torch.randn(5, 3, 17, 64, generator=g)
    packed, gain = residual.encode(r, kind, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 17, 8) and gain.shape == (5, 3, 17, 1)
    u = r @ residual.basis(64).T
    signs = residual.decode(packed, torch.ones_like(gain)) @ residual.basis(64).T  # back to S's basis: +-1
    assert torch.allclose(signs, torch.where(u >= 0, 1.0, -1.0), atol=1e-5)
    want = u.abs().mean(-1, keepdim=True) if kind == "sign" else r.norm(dim=-1, keepdim=True) * math.sqrt(math.pi / 128)
    assert torch.allclose(gain, want, rtol=0.07 if fmt == "ue5m3" else 1e-3)  # ue5m3: 3 mantissa bits


def test_sign_gain_is_least_squares_and_qjl_unbiased():
    g = torch.Generator().manual_seed(2)
    r = torch.randn(20000, 64, generator=g)
    q = torch.randn(64, generator=g)
    for kind in residual.KINDS:
        packed, gain = residual.encode(r, kind)
        rh = residual.decode(packed, gain)
        if kind == "sign":  # any other gain of the same signs fits worse
            err = ((rh - r) ** 2).sum()
            for f in (0.9, 1.1):
                assert ((rh * f - r) ** 2).sum() > err
            assert err / (r ** 2).sum() < 1 - 2 / math.pi + 0.02  # the Gaussian sign quantizer's 0.36
        else:  # <q, r_hat> regresses on <q, r> with slope ~1
            a, b = r @ q, rh @ q
            assert abs(float((a * b).sum() / (a * a).sum()) - 1) < 0.03


def test_codec_stores_counts_and_decodes_the_residual():
    tq = TensorQuant(bits=2, zero="none", grid="mse", scale_format="ue5m3", residual="sign")
    c = TensorCodec(tq, 64, 16)
    assert c.fields() == {"codes": 16, "scale": 1, "rbits": 8, "rgain": 1}
    assert {n: c.field_dtype(n, torch.bfloat16) for n in c.fields()} == dict.fromkeys(c.fields(), torch.uint8)
    assert codec_bits_per_token(c) / 64 == tq.bits_per_element(64) == 3.25  # 2 + 8/64 + 1 + 8/64
    x = torch.randn(2, 3, 33, 64, generator=torch.Generator().manual_seed(3))
    f = c.encode(x, torch.bfloat16)
    base = TensorCodec(TensorQuant(bits=2, zero="none", grid="mse", scale_format="ue5m3"), 64, 16)
    fb = base.encode(x, torch.bfloat16)
    assert torch.equal(f["codes"], fb["codes"]) and torch.equal(f["scale"], fb["scale"])  # the same base
    xb = base.decode(fb)
    got = c.decode(f)
    assert torch.allclose(got, xb + residual.decode(f["rbits"], sf.decode(f["rgain"])), atol=1e-5)
    assert ((got - x) ** 2).mean() < 0.45 * ((xb - x) ** 2).mean()  # the residual takes out most of the error


def test_recipes_name_the_residual_per_layer():
    s = parse_kv_scheme("int2", zero="none", grid="mse", layer_bits="3,7=k2rv2;5=k4v2q;9=k4v2")
    assert s.for_layer(0).k.residual is None
    assert s.for_layer(3).k.residual == "sign" and s.for_layer(3).v.residual is None
    assert s.for_layer(5).k.residual is None and s.for_layer(5).v.residual == "qjl"
    assert s.for_layer(5).k.bits == 4
    both = parse_kv_scheme("int2", zero="none", residual="qjl,none", layer_bits="2=k4v2")
    assert both.for_layer(0).k.residual == "qjl" and both.for_layer(2).k.residual is None  # the override states it
    assert "1-bit sign residual" in s.for_layer(3).k.describe()


@pytest.mark.parametrize("kw, match", [
    ({"residual": "sign"}, "scale-only"),  # int2 with a stored zero
    ({"zero": "none", "residual": "jl"}, "residual 'jl' unknown"),
    ({"zero": "none", "layer_bits": "0=k16rv2"}, "per-layer residual"),
])
def test_bad_residual_settings_are_one_line_errors(kw, match):
    with pytest.raises(LowbitError, match=match):
        parse_kv_scheme("int2", **kw).for_layer(0)
